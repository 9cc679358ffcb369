"""A frozen base sharded across the processes of a run with PyTorch's FSDP2 (``fully_shard``).

For models bigger than one GPU: each of the model's blocks (the classes the model lists in ``_no_split_modules``,
e.g. ``LlamaDecoderLayer``) and then the model itself become FSDP units whose *frozen* weights are split across the
ranks (each rank stores 1/W of them, all-gathered one block at a time for the forward and again for the backward).
The trained tensors (LoRA factors, a head) are ``ignored_params``: plain, replicated tensors trained by the
multi-process mechanism as before (:mod:`prismdp.distributed`: per-example clipping on the rank that holds the
example, the clipped sums all-reduced once per step, the noise drawn once, replicas checked). FSDP never sees a
gradient, so it reduce-scatters nothing.

What changes for the rest of the run:

* every forward and backward is a collective: all ranks must run the same number of micro-steps, in the same order.
  A rank with fewer micro-batches in a logical step runs *idle* ones (:class:`prismdp.processes.Lockstep`), whose
  gradient is discarded;
* the frozen weight ``W0`` of a LoRA layer is a ``DTensor``: the rank-r start reads it whole one layer at a time
  (:func:`full_weight`, through :func:`prismdp.base.read_weight`) and writes back only each rank's shard
  (:func:`assign_weight`);
* evaluation runs on every rank (the forward is a collective); rank 0 alone writes the files;
* ``prismdp train --fsdp`` reads the weights on rank 0 alone: the other ranks build the model on the meta device,
  and block by block every rank receives the block from rank 0 and shards it (:func:`shard_from_rank0`), so host
  memory holds one whole model (rank 0's, memory-mapped where the checkpoint is safetensors in ``--dtype``), not one
  per process, and no rank holds more than one unit whole besides its shards;
* ``--quantize 4bit --fsdp`` (QLoRA sharded): each block's frozen linear weights are held in torchao's NF4 before
  the block is sharded (FSDP2 cannot shard bitsandbytes' packed weights; torchao's ``NF4Tensor`` shards and
  all-gathers as it is); the rank-r start de-quantizes one gathered layer at a time.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from .dtensor import assign_weight, full_weight, is_sharded
from .nf4 import quantize_nf4_layers
from .storage import BaseError

__all__ = ["ShardingError", "check_torch", "check_world", "shard_frozen_base", "shard_from_rank0", "is_sharded", "full_weight",
           "assign_weight", "block_classes"]


class ShardingError(BaseError):
    """The model cannot be sharded as asked."""


FULLY_SHARD_TORCH = "2.7"  # fully_shard(ignored_params=...): pytorch/pytorch#146631, first released in torch 2.7


def check_torch(fully_shard=None) -> None:
    """Refuse ``--fsdp`` on a torch whose ``fully_shard`` cannot leave the trained tensors out (``ignored_params``)."""
    import inspect

    if fully_shard is None:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            fully_shard = None
    if fully_shard is None or "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise ShardingError(f"--fsdp needs torch >= {FULLY_SHARD_TORCH} (FSDP2's fully_shard(ignored_params=...), "
                            f"which keeps the trained LoRA factors whole); this is torch {torch.__version__}. Fix: "
                            f"pip install 'torch>={FULLY_SHARD_TORCH}', or leave --fsdp out.")


def check_world(world) -> None:
    """Refuse to shard without several processes or on a torch that cannot (before anything is loaded)."""
    check_torch()
    if world is None or world.size < 2:
        raise ShardingError("--fsdp shards the base model across the processes of a torchrun job, and this run has one "
                            "process. Fix: start it with `torchrun --nproc-per-node N -m prismdp train --fsdp ...` "
                            "(N >= 2), or leave --fsdp out.")


def block_classes(model: nn.Module) -> set[str]:
    """The class names of the model's repeated blocks: ``_no_split_modules`` of the (PEFT-wrapped) transformers
    model, the units Hugging Face's own FSDP wrapping uses."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set()
    for module in base.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    return names


def _shard_units(model: nn.Module, world, blocks, prepare) -> None:
    """``fully_shard`` every block of ``model`` (class names ``blocks``; default :func:`block_classes`), then the
    transformers model inside PEFT's wrappers, each with the trained parameters left out (``ignored_params``);
    ``prepare(name, unit, is_block)`` runs on each unit just before it is sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _refuse_bitsandbytes(model)
    check_world(world)
    if is_sharded(model):
        raise ShardingError("the model is sharded already (it holds DTensor parameters); shard it once")
    names = set(blocks) if blocks is not None else block_classes(model)
    units = [(name, m, True) for name, m in model.named_modules() if type(m).__name__ in names]
    if not units:
        raise ShardingError(f"no block of {type(model).__name__} to shard: the model lists no _no_split_modules "
                            "(transformers models do). Fix: pass blocks=[<the class name of its layers>].")
    # the root unit is the transformers model inside PEFT's wrappers: generate() and PEFT's forward both call its
    # forward, whose hooks gather the weights outside the blocks (embeddings, final norm, head)
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    units.append((next(name for name, m in model.named_modules() if m is root), root, False))
    mesh = init_device_mesh(world.device.type, (world.size,))
    for name, unit, is_block in units:
        prepare(name, unit, is_block)
        fully_shard(unit, mesh=mesh, ignored_params={p for p in unit.parameters() if p.requires_grad})


def _refuse_bitsandbytes(model: nn.Module) -> None:
    packed = [name for name, p in model.named_parameters() if type(p).__name__ in ("Params4bit", "Int8Params")]
    if packed:
        raise ShardingError(f"{packed[0]} is a bitsandbytes-quantized weight, which FSDP cannot shard. Fix: load the "
                            "base in bf16 and shard it with quantize='nf4' (torchao's NF4, the same 4-bit format; "
                            "prismdp train --fsdp --quantize 4bit does this), or shard it unquantized")


def _quantizer(quantize: str | None, world):
    """The ``prepare`` step that holds a block's frozen linear weights in NF4, and the record it fills: the names
    held in NF4 (``"nf4"``) and those left in float (``"float"``), both lists, empty without ``quantize``."""
    if quantize not in (None, "nf4"):
        raise ShardingError(f"quantize must be None or 'nf4' (torchao's NF4, 4 bits), got {quantize!r}")
    quantized: dict[str, list[str]] = {"nf4": [], "float": []}

    def prepare(name, unit, is_block):
        if quantize and is_block:

            done, left = quantize_nf4_layers(unit, world.size)
            quantized["nf4"] += [f"{name}.{n}" for n in done]
            quantized["float"] += [f"{name}.{n}" for n in left]
    return prepare, quantized


def shard_frozen_base(model: nn.Module, world, blocks: Iterable[str] | None = None,
                      quantize: str | None = None) -> dict[str, list[str]]:
    """Shard ``model``'s frozen weights across ``world``'s processes with FSDP2, in place: ``fully_shard`` on every
    block (``blocks``: class names; default :func:`block_classes`), then on the transformers model (inside a PEFT
    model's wrappers), each with the trained parameters left out (``ignored_params``).  ``quantize="nf4"``: each
    block's frozen linear weights are first held in torchao's NF4 (4 bits; QLoRA's format), one block at a time.
    Call it after LoRA is on the model and before :func:`prismdp.engine.make_private` (whose rank-r start then
    gathers one layer at a time).  Returns the names of the layers held in NF4 (``"nf4"``) and of those left in
    float because of their shape (``"float"``), both lists (empty without ``quantize``)."""
    prepare, quantized = _quantizer(quantize, world)
    _shard_units(model, world, blocks, prepare)
    return quantized


def shard_from_rank0(model: nn.Module, world, whole: nn.Module | None, blocks: Iterable[str] | None = None,
                     quantize: str | None = None) -> dict[str, list[str]]:
    """:func:`shard_frozen_base` for a ``model`` built on the meta device (the same on every rank), whose values come
    from ``whole``: the same model (LoRA on it) loaded whole into host memory on rank 0 (None on the other ranks),
    in any dtype (e.g. the checkpoint's, memory-mapped: each value is converted to the skeleton's dtype as it is sent).
    Unit by unit, each rank makes the unit's tensors on ``world.device`` with rank 0's values (broadcast), holds its
    linear weights in NF4 if asked, and shards it; tensors outside every unit (and buffers, which a state dict may
    leave out: rotary frequencies) are broadcast whole.  Every rank then holds what it would had it loaded the model
    itself, and no rank ever holds more than one block whole besides its shards.  A collective."""
    if (world.rank == 0) != (whole is not None):
        raise ShardingError("shard_from_rank0: rank 0 passes the model it loaded, the other ranks None")
    source = dict(whole.named_modules()) if whole is not None else None
    made: dict[int, tuple[Tensor, Tensor | None]] = {}
    quantize_block, quantized = _quantizer(quantize, world)

    def prepare(name, unit, is_block):
        for key, (meta, _) in made.items():  # the units made before are sharded now: their whole tensors can go
            made[key] = (meta, None)
        _from_rank0(unit, name, world, source, made)
        quantize_block(name, unit, is_block)

    _shard_units(model, world, blocks, prepare)
    _from_rank0(model, "", world, source, made)
    return quantized


@torch.no_grad()
def _from_rank0(module: nn.Module, prefix: str, world, source: dict | None, made: dict) -> None:
    """Replace every meta tensor of ``module`` (named from ``prefix``) by one on ``world.device`` holding rank 0's
    value of it (``source``: rank 0's modules by name), broadcast from rank 0; tied tensors stay tied (``made``: meta
    tensor id -> (meta tensor, value), the value None once its unit is sharded, so that no rank keeps a sharded
    unit's tensors whole)."""
    import torch.distributed as dist

    for name, mod in module.named_modules(prefix=prefix):
        for table in ("_parameters", "_buffers"):
            tensors = getattr(mod, table)
            for key, meta in list(tensors.items()):
                if meta is None or not meta.is_meta:
                    continue
                if id(meta) not in made:
                    value = torch.empty_like(meta, device=world.device)
                    if source is not None:
                        value.copy_(getattr(source[name], table)[key])
                    dist.broadcast(value, 0)
                    if table == "_parameters":
                        value = nn.Parameter(value, requires_grad=meta.requires_grad)
                    made[id(meta)] = (meta, value)  # the meta tensor kept alive: its id stays its own
                elif made[id(meta)][1] is None:
                    raise ShardingError(f"{name}.{key} is tied to a tensor of an FSDP unit sharded before it; FSDP "
                                        "shards each tensor in one unit. Fix: untie them, or pass blocks= so that "
                                        "both are in one unit")
                tensors[key] = made[id(meta)][1]
