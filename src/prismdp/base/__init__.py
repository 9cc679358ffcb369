"""The frozen base behind one seam: how the base model's weights are stored, and what the rest of prismdp needs from
that storage.  Nothing above this package (the LoRA pairs, the rank-r start, the engine, the front ends) knows a
storage kind; each kind is one module here and one :func:`register_storage` call in it:

* :mod:`~prismdp.base.floating`: a float weight (any dtype), the only one the rank-r start may rewrite;
* :mod:`~prismdp.base.bnb`: bitsandbytes' 4- and 8-bit layers (``--quantize 4bit|8bit`` in one process);
* :mod:`~prismdp.base.nf4`: torchao's NF4 tensors (``--quantize 4bit --fsdp``);
* :mod:`~prismdp.base.sharded`: any of them sharded across the processes with FSDP2 (``--fsdp``), orthogonal to the
  kind: a sharded weight is gathered before it is read, and a write keeps each rank's shard.

The seam, per frozen layer: :func:`read_weight` (``W0`` whole, de-quantized or gathered, one layer at a time),
:func:`start_in_base` (whether ``W0 - Z0`` can be written into it, else the start goes into the LoRA branch),
:func:`write_weight`, :func:`storage_name`; per model: :func:`check_base` (the one place the rules of ``quantize``,
``fsdp``, ``dtype`` and the device are checked), :func:`prepare_base` (shard / hold in NF4, then describe) and
:func:`describe_base` (a model the user built: its layouts kept, and whether its forwards are collectives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from . import bnb, nf4, sharded
from . import floating  # noqa: F401  (registered last: the fallback that holds any weight)
from .sharded import ShardingError, check_world, is_sharded
from .storage import STORAGES, BaseError, Storage, register_storage, storage_of

__all__ = ["BaseError", "ShardingError", "Storage", "STORAGES", "register_storage", "storage_of", "storage_name",
           "read_weight", "write_weight", "start_in_base", "keep_layouts", "FrozenBase", "QUANTIZE", "check_base",
           "prepare_base", "describe_base", "is_sharded"]

QUANTIZE = ("4bit", "8bit")  # --quantize: bitsandbytes in one process; 4bit with --fsdp: torchao's NF4


def storage_name(layer: nn.Module) -> str:
    """``"float"``, ``"4bit"`` / ``"8bit"`` (bitsandbytes) or ``"nf4"`` (torchao), sharded or not."""
    return storage_of(layer).name


def read_weight(layer: nn.Module, dtype: torch.dtype = torch.float64) -> Tensor:
    """The frozen ``layer``'s weight (out, in) in ``dtype`` as the layer multiplies by it: de-quantized by its own
    library, a shard gathered whole (a collective: every rank reads the same layers in the same order); one layer's
    copy."""
    return storage_of(layer).read(layer).to(dtype)


def start_in_base(layer: nn.Module) -> bool:
    """Whether ``W0 - Z0`` can be written into ``layer``'s weight (a float weight, sharded or not); a quantized one
    has no room for it (re-quantized it would change the model): the rank-r start then goes into the LoRA branch."""
    return storage_of(layer).writable


def write_weight(layer: nn.Module, value: Tensor) -> None:
    """Store a full-size ``value`` (out, in) that every rank holds alike in ``layer``'s weight (a sharded weight keeps
    its own shard); refused for a storage that cannot take it (:func:`start_in_base`)."""
    storage = storage_of(layer)
    if storage.write is None:
        raise BaseError(f"a {storage.name} weight cannot be rewritten (it would be quantized again): keep the "
                        "rank-r start in the LoRA branch, or train an unquantized base")
    storage.write(layer, value)


def keep_layouts(model: nn.Module) -> None:
    """Run every storage kind's layout fix on the layers it holds (bitsandbytes' 4-bit layers keep their canonical
    layout through evaluations, :func:`prismdp.base.bnb.keep_canonical_layout`)."""
    for module in model.modules():
        fix = storage_of(module).keep_layout
        if fix is not None:
            fix(module)


@dataclass(frozen=True)
class FrozenBase:
    """What the rest of a run needs to know of its frozen base, model-wide."""

    storages: frozenset[str]  # the storage kinds of its layers ("float", "4bit", "8bit", "nf4")
    sharded: bool  # some weight is a DTensor (FSDP2)
    lockstep: bool  # every forward and backward is a collective: the ranks run the same number of micro-steps
    held: dict[str, list[str]] = field(default_factory=lambda: {"nf4": [], "float": []})  # prepare_base's NF4 record

    @property
    def quantized(self) -> bool:
        return bool(self.storages - {"float"})


def check_base(quantize: str | None = None, fsdp: bool = False, *, world=None, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> None:
    """The rules of ``quantize``, ``fsdp``, ``dtype`` and the device, checked before anything is loaded; raises
    :class:`BaseError` (:class:`ShardingError` for a run that has no processes to shard across) naming the fix."""
    if quantize not in (None, *QUANTIZE):
        raise BaseError(f"must be 4bit, 8bit or null (an unquantized base), got {quantize!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise BaseError(f"the base's dtype must be a floating torch dtype (float32, bfloat16, float16), got {dtype!r}")
    if fsdp:
        check_world(world)
        if quantize == "8bit":
            raise BaseError("--fsdp with --quantize 8bit: FSDP cannot shard bitsandbytes' int8 weights. Fix: "
                            "--quantize 4bit (sharded as torchao's NF4), or shard a bf16 base (--fsdp --dtype "
                            "bfloat16), or quantize it in each process (--quantize 8bit without --fsdp)")
        if quantize:
            try:
                nf4.nf4_available()
            except ImportError as e:
                raise BaseError(str(e)) from None
    elif quantize:
        try:
            bnb.bitsandbytes(device)
        except ImportError as e:
            raise BaseError(str(e)) from None


def describe_base(model: nn.Module, world=None, held: dict[str, list[str]] | None = None) -> FrozenBase:
    """Describe the frozen base of ``model`` (a model the user built, or one :func:`prepare_base` made), keeping
    every layer's layout (:func:`keep_layouts`).  ``world``: the run's process group (None in one process); a
    sharded base makes every forward a collective (``lockstep``)."""
    keep_layouts(model)
    storages = frozenset(storage_of(m).name for m in model.modules() if isinstance(getattr(m, "weight", None), Tensor))
    shard = is_sharded(model)
    return FrozenBase(storages, shard, world is not None and shard, held or {"nf4": [], "float": []})


def prepare_base(model: nn.Module, quantize: str | None = None, fsdp: bool = False, dtype: torch.dtype | None = None,
                 world=None, *, device: torch.device | str | None = None, whole: nn.Module | None = None,
                 blocks=None) -> FrozenBase:
    """Store ``model``'s frozen base as asked, in place, and describe it (:func:`describe_base`): the rules checked
    (:func:`check_base`); with ``fsdp`` every block sharded across ``world`` with FSDP2 (the trained tensors left
    whole), each block's linear weights first held in torchao's NF4 where ``quantize`` is ``"4bit"``: a model built
    on the meta device takes its values from ``whole``, the same model loaded on rank 0 (None on the other ranks;
    :func:`~prismdp.base.sharded.shard_from_rank0`), a loaded one is sharded as it is
    (:func:`~prismdp.base.sharded.shard_frozen_base`).  Without ``fsdp`` a ``quantize`` base is the one bitsandbytes
    loaded on its device (:func:`prismdp.models.load_model`): its layouts are kept; a float one is moved to ``device``
    (if given).  Call it after LoRA is on the model and before :func:`prismdp.engine.make_private`."""
    check_base(quantize, fsdp, world=world, dtype=dtype, device=device)
    held = None
    if not fsdp and not quantize and device is not None:
        model.to(device)
    if fsdp:
        nf4_kind = "nf4" if quantize else None
        if whole is not None or any(p.is_meta for p in model.parameters()):
            held = sharded.shard_from_rank0(model, world, whole, blocks=blocks, quantize=nf4_kind)
        else:
            held = sharded.shard_frozen_base(model, world, blocks=blocks, quantize=nf4_kind)
    return describe_base(model, world, held)
