"""A frozen base held in 4 or 8 bits: its weight as the layer multiplies by it, and the layout that keeps it so.
Pure helpers on one layer, importing nothing of prismdp but :mod:`prismdp.quiet`; :mod:`prismdp.lora` reads ``W0`` through them,
:mod:`prismdp.sharding` holds a block in NF4 before sharding it, and :mod:`prismdp.models` / :mod:`prismdp.engine`
keep every 4-bit layer in its canonical layout.

Two holders of a quantized weight:

* bitsandbytes (``--quantize 4bit|8bit`` in one process): ``Linear4bit`` (NF4) / ``Linear8bitLt``, whose packed
  ``Params4bit`` / ``Int8Params`` FSDP cannot shard;
* torchao's ``NF4Tensor`` (``--quantize 4bit --fsdp``): QLoRA's NF4 (the same 16-value code book, blocks of 64
  weights, double-quantized block scales) as a tensor subclass that FSDP2 shards and all-gathers as it is
  (torchtune's QLoRA path).  The layer stays an ``nn.Linear`` whose weight is an ``NF4Tensor`` (a ``DTensor`` of
  them once sharded); its forward de-quantizes to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .quiet import install as install_quiet

__all__ = ["dequantized_weight", "keep_canonical_layout", "is_nf4", "nf4_scaler_block_size", "to_nf4_weight",
           "quantize_nf4_layers", "nf4_available", "TORCHAO_INSTALL"]

TORCHAO_INSTALL = "pip install 'torchao>=0.18'"
NF4_BLOCK = 64  # weights per NF4 block (QLoRA's)


def dequantized_weight(base: nn.Module, kind: str) -> Tensor:
    """bitsandbytes' own de-quantization of a ``Linear4bit`` / ``Linear8bitLt`` weight (m, n) (``kind`` ``"4bit"`` /
    ``"8bit"``), leaving the layer as it is (PEFT's ``dequantize_module_weight`` re-assigns an 8-bit weight and loses
    its scales on CPU).  A torchao ``NF4Tensor`` de-quantizes itself (``get_original_weight``)."""
    import bitsandbytes.functional as bnb_f

    keep_canonical_layout(base)
    w = base.weight
    if kind == "4bit":
        return bnb_f.dequantize_4bit(w.data, w.quant_state)
    scb = w.SCB if getattr(w, "SCB", None) is not None else base.state.SCB  # moved to the state by the first forward
    return bnb_f.int8_vectorwise_dequant(w.data, scb)


def keep_canonical_layout(layer: nn.Module) -> None:
    """Keep a bitsandbytes ``Linear4bit`` in its canonical NF4 layout, which its training forward and backward, its
    de-quantization and its saved state all use.  bitsandbytes' CPU backend (0.49+), on a CPU with AVX512-BF16,
    otherwise repacks the weight in place at the first forward in eval mode without gradients (an evaluation) into a
    layout for a bf16 kernel, with its block scales rounded to bf16: the model then computes something else than it
    trained (and what it exports), ``dequantize_4bit`` of the repacked weight is wrong, and so is the backward of a
    later training step.  A weight already repacked is brought back as bitsandbytes does before saving it."""
    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is not None and getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    if hasattr(layer, "support_avx512bf16_for_cpu"):
        layer.support_avx512bf16_for_cpu = False


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
