"""A frozen base held by bitsandbytes (``--quantize 4bit|8bit``): its weight as the layer multiplies by it, and the
layout that keeps it so.  Pure helpers on one bitsandbytes layer; :mod:`prismdp.lora` reads ``W0`` through them and
:mod:`prismdp.models` / :mod:`prismdp.engine` keep every 4-bit layer in its canonical layout."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["dequantized_weight", "keep_canonical_layout"]


def dequantized_weight(base: nn.Module, kind: str) -> Tensor:
    """bitsandbytes' own de-quantization of a ``Linear4bit`` / ``Linear8bitLt`` weight (m, n), leaving the layer as it
    is (PEFT's ``dequantize_module_weight`` re-assigns an 8-bit weight and loses its scales on CPU)."""
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
