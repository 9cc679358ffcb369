"""bitsandbytes' 4- and 8-bit layers (``--quantize 4bit|8bit`` in one process): ``Linear4bit`` (NF4) /
``Linear8bitLt``, whose packed ``Params4bit`` / ``Int8Params`` FSDP cannot shard.  Their weight is read through
bitsandbytes' own de-quantization and never rewritten (``W0 - Z0`` re-quantized would change the model by a new
quantization error); the canonical 4-bit layout is kept through evaluations.  bitsandbytes is imported only where a
model holds such a layer."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .storage import Storage, register_storage

__all__ = ["dequantized_weight", "keep_canonical_layout", "bnb_kind", "bitsandbytes", "BNB_MIN_CPU", "BNB_INSTALL"]

BNB_MIN_CPU = (0, 50)  # the bitsandbytes release whose CPU backend carries prismdp's tests (4- and 8-bit training)
BNB_INSTALL = "pip install 'bitsandbytes>=0.50'"

_PARAMS = {"Params4bit": "4bit", "Int8Params": "8bit"}  # bitsandbytes' weight classes, matched by name


def bnb_kind(weight) -> str | None:
    """``"4bit"`` / ``"8bit"`` where ``weight`` is a bitsandbytes ``Params4bit`` / ``Int8Params``, else None."""
    return _PARAMS.get(type(weight).__name__)


def bitsandbytes(device=None):
    """bitsandbytes, or an ImportError naming the fix: it must be installed, and on the CPU it must be a release
    with a CPU backend (0.50 and later here; on CUDA any recent one)."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError(f"a quantized base (--quantize) needs bitsandbytes: {BNB_INSTALL} ({e}); or train "
                          "without --quantize (e.g. --dtype bfloat16)") from e
    version = tuple(int(p) for p in bnb.__version__.split(".")[:2] if p.isdigit())
    if torch.device(device or "cpu").type == "cpu" and version < BNB_MIN_CPU:
        raise ImportError(f"bitsandbytes {bnb.__version__} has no CPU backend for a quantized base: "
                          f"{BNB_INSTALL} --upgrade, or train on a CUDA GPU (--device cuda), or without --quantize")
    return bnb


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



def _storage(kind: str) -> Storage:
    return Storage(kind, holds=lambda layer: bnb_kind(getattr(layer, "weight", None)) == kind,
                   read=lambda layer: dequantized_weight(layer, kind), keep_layout=keep_canonical_layout)


BNB_4BIT = register_storage(_storage("4bit"))
BNB_8BIT = register_storage(_storage("8bit"))
