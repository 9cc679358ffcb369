"""torchao's ``NF4Tensor`` (``--quantize 4bit --fsdp``): QLoRA's NF4 (the same 16-value code book, blocks of 64
weights, double-quantized block scales) as a tensor subclass that FSDP2 shards and all-gathers as it is (torchtune's
QLoRA path).  The layer stays an ``nn.Linear`` whose weight is an ``NF4Tensor`` (a ``DTensor`` of them once sharded);
its forward de-quantizes to the input's dtype.  The weight is read de-quantized (one gathered layer at a time) and
never rewritten."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..quiet import install as install_quiet
from .dtensor import gather_rows, is_sharded
from .storage import Storage, register_storage

__all__ = ["is_nf4", "nf4_scaler_block_size", "to_nf4_weight", "quantize_nf4_layers", "nf4_available",
           "dequantized", "TORCHAO_INSTALL"]

TORCHAO_INSTALL = "pip install 'torchao>=0.18'"
NF4_BLOCK = 64  # weights per NF4 block (QLoRA's)


def is_nf4(weight) -> bool:
    """Whether ``weight`` is a torchao ``NF4Tensor``, or a ``DTensor`` whose shards are (matched by class name:
    torchao is imported only where a model uses it)."""
    return type(getattr(weight, "_local_tensor", weight)).__name__ == "NF4Tensor"


def nf4_available() -> None:
    """Raise the ImportError naming the fix where torchao's NF4 is missing (checked before any weight is read)."""
    _torchao_nf4()


def _torchao_nf4():
    """torchao's ``to_nf4``, or an ImportError naming the fix (torchao's import-time messages about CUDA kernels a CPU
    build cannot load are filtered by :mod:`prismdp.quiet`)."""
    install_quiet()
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        try:
            from torchao.dtypes import to_nf4  # older releases
        except ImportError as e:
            raise ImportError(f"a 4-bit base sharded with FSDP (--quantize 4bit --fsdp) is held by torchao's NF4: "
                              f"{TORCHAO_INSTALL} ({e}); or shard a bf16 base (--fsdp --dtype bfloat16), or "
                              "quantize it in each process with bitsandbytes (--quantize 4bit without --fsdp)") from e
    return to_nf4


def nf4_scaler_block_size(numel: int, world_size: int = 1) -> int | None:
    """The number of NF4 block scales quantized together (QLoRA's double quantization; 256 by default), for a weight
    of ``numel`` elements to be split over ``world_size`` shards: the largest power of two up to 256 that divides the
    number of blocks and leaves a number of groups divisible by ``world_size`` (FSDP splits every inner tensor of the
    NF4 weight, the groups' 8-bit scales included, into equal shards).  None where no size works (the layer then
    stays in float)."""
    if numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    size = 256
    while size >= 1:
        if blocks % size == 0 and (blocks // size) % world_size == 0:
            return size
        size //= 2
    return None


def to_nf4_weight(weight: Tensor, world_size: int = 1) -> Tensor | None:
    """``weight`` (m, n) as a frozen torchao ``NF4Tensor`` parameter (blocks of 64, double-quantized scales; its
    de-quantization has ``weight``'s dtype) that FSDP can split into ``world_size`` row shards; None where its shape
    does not allow it (see :func:`nf4_scaler_block_size`; the rows must split evenly too)."""
    size = nf4_scaler_block_size(weight.numel(), world_size)
    if size is None or weight.dim() != 2 or weight.shape[0] % world_size:
        return None
    return nn.Parameter(_torchao_nf4()(weight.detach(), NF4_BLOCK, size), requires_grad=False)


@torch.no_grad()
def quantize_nf4_layers(module: nn.Module, world_size: int = 1, keep=()) -> tuple[list[str], list[str]]:
    """Hold the weight of every frozen ``nn.Linear`` in ``module`` (PEFT's ``base_layer`` of a LoRA layer, or a layer
    without LoRA) as a torchao ``NF4Tensor``, in place, one layer at a time; layers whose name has a component in
    ``keep`` (an output head: ``lm_head``, ``score``), trained layers and layers on the meta device are left as they
    are.  ``world_size``: the number of shards FSDP will split each weight into.  Returns the names quantized and
    the names left in float because their shape does not allow NF4 blocks (:func:`to_nf4_weight`)."""
    keep, done, left = set(keep), [], []
    for name, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        if (type(layer) is not nn.Linear or weight.requires_grad or weight.is_meta or is_nf4(weight)
                or keep & set(name.split("."))):
            continue
        nf4 = to_nf4_weight(weight, world_size)
        if nf4 is None:
            left.append(name)
        else:
            layer.weight = nf4
            done.append(name)
    return done, left


def dequantized(weight: Tensor) -> Tensor:
    """The de-quantized whole of an NF4 weight.  Sharded, each rank de-quantizes its own rows (an NF4 shard is an NF4
    tensor of those rows: blocks and scale groups never straddle shards, :func:`to_nf4_weight`) and the rows are
    gathered by a synchronous c10d all-gather (a collective), not by ``DTensor.full_tensor()``, whose functional
    all-gathers of the NF4's inner tensors were seen still in flight after it returned, and whose path stayed the
    suspect of heap corruption in sharded-NF4 gloo runs after those were waited for."""
    if is_sharded(weight):
        return gather_rows(weight.to_local().get_original_weight(), weight)
    return weight.get_original_weight()


NF4 = register_storage(Storage("nf4", holds=lambda layer: is_nf4(getattr(layer, "weight", None)),
                               read=lambda layer: dequantized(layer.weight)))
