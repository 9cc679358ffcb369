"""PEFT LoRA pairs as points on the rank-r manifold.

For one PEFT ``lora.Linear`` module with frozen ``W0`` (m x n), ``lora_A.weight`` ``W_A`` (r x n),
``lora_B.weight`` ``W_B`` (m x r) and ``scaling`` s, the intrinsic parameter is the weight delta
``Z = s W_B W_A``.  We use the symmetric split ``A = sqrt(s) W_B`` (m x r), ``B = sqrt(s) W_A^T`` (n x r),
so ``Z = A B^T`` and the factor gradients are ``gA = dL/dW_B / sqrt(s)``, ``gB = (dL/dW_A)^T / sqrt(s)``.

This module finds and validates the pairs (PEFT's ``lora.Linear``, and its bitsandbytes ``Linear4bit`` /
``Linear8bitLt`` on a quantized base: the per-example taps sit on ``lora_A`` / ``lora_B``, plain ``nn.Linear`` in
every PEFT LoRA layer, whose input is the layer's input, so the quantized weight never enters the per-example
gradients) and reads and writes their factors.  How ``W0`` is stored is :mod:`prismdp.base`'s; the rank-r start
(PEFT's ``W_B = 0`` is off the manifold) is :mod:`prismdp.lora.start`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import base as frozen

__all__ = ["LoraPair", "LoraSetupError", "find_lora_pairs", "freeze_lora_A", "get_factors", "set_factors",
           "stack_by_shape", "quantized_base"]


class LoraSetupError(ValueError):
    """The model's LoRA configuration cannot be trained by prismdp as it is."""


@dataclass(frozen=True)
class LoraPair:
    """One LoRA module: where it lives and how its factors map to ``Z = A B^T``."""

    name: str
    layer: nn.Module  # the peft lora.Linear wrapper
    adapter: str
    trainable: str = "both"  # "both" factors, or "B" only (lora_A frozen, e.g. FFA-LoRA)

    @property
    def lora_A(self) -> nn.Linear:  # W_A: (r, n)
        return self.layer.lora_A[self.adapter]

    @property
    def lora_B(self) -> nn.Linear:  # W_B: (m, r)
        return self.layer.lora_B[self.adapter]

    @property
    def scaling(self) -> float:
        return float(self.layer.scaling[self.adapter])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(m, n, r)."""
        r, n = self.lora_A.weight.shape
        return self.lora_B.weight.shape[0], n, r

    @property
    def params(self) -> tuple[nn.Parameter, nn.Parameter]:
        return self.lora_A.weight, self.lora_B.weight

    @property
    def trains_A(self) -> bool:
        return self.trainable == "both"

    @property
    def trained_params(self) -> tuple[nn.Parameter, ...]:
        """The trained factors in :class:`~prismdp.grad_sample.PerExampleGrads` order: (lora_B[, lora_A])."""
        return (self.lora_B.weight, self.lora_A.weight) if self.trains_A else (self.lora_B.weight,)


_BNB_LORA = ("Linear4bit", "Linear8bitLt")  # PEFT's LoRA layers on bitsandbytes' quantized Linear layers


def _is_lora_linear(module: nn.Module) -> bool:
    """PEFT's LoRA ``Linear``, or its bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` (matched by class, without
    importing bitsandbytes where no model uses it)."""
    from peft.tuners.lora.layer import Linear

    cls = type(module)
    return isinstance(module, Linear) or (cls.__module__ == "peft.tuners.lora.bnb" and cls.__name__ in _BNB_LORA)


def quantized_base(pair: LoraPair) -> str | None:
    """``"4bit"`` / ``"8bit"`` where the pair's base layer holds a bitsandbytes-quantized weight, ``"nf4"`` where it
    holds a torchao ``NF4Tensor`` (sharded or not), else None (:func:`prismdp.base.storage_name`)."""
    name = frozen.storage_name(pair.layer.get_base_layer())
    return None if name == "float" else name


def freeze_lora_A(model: nn.Module, adapter: str = "default") -> None:
    """Freeze every ``lora_A`` factor of ``adapter`` at its current value (FFA-LoRA keeps PEFT's random init)."""
    from peft.tuners.lora.layer import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
            module.lora_A[adapter].weight.requires_grad_(False)


def find_lora_pairs(model: nn.Module, adapter: str = "default", trainable: str = "both") -> list[LoraPair]:
    """All trainable PEFT LoRA ``Linear`` pairs of ``adapter``; validates what prismdp supports.

    ``trainable="both"`` takes the pairs whose two factors are trainable; ``trainable="B"`` the pairs whose
    ``lora_B`` is trainable and whose ``lora_A`` is frozen (call :func:`freeze_lora_A` first), as FFA-LoRA trains.

    Raises :class:`LoraSetupError` (naming the module and the fix) for LoRA layers of other types
    (embedding, conv, ...), DoRA / other variants, LoRA biases, r >= min(m, n), a trainable ``lora_A`` with
    ``trainable="B"``, or no pair at all.
    """
    from peft.tuners.lora.layer import LoraLayer

    if trainable not in ("both", "B"):
        raise ValueError(f"trainable must be 'both' or 'B', got {trainable!r}")

    pairs: list[LoraPair] = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in getattr(module, "r", {}):
            continue
        if not _is_lora_linear(module):
            raise LoraSetupError(
                f"LoRA module {name!r} is a {type(module).__name__}; prismdp supports LoRA on Linear layers only. "
                "Fix: restrict target_modules to linear projections (e.g. q_proj, v_proj)."
            )
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is not None and not getattr(variant, "prismdp_rank_r_start", False):  # not the start's own
            raise LoraSetupError(
                f"LoRA module {name!r} uses a LoRA variant (e.g. DoRA); prismdp supports plain LoRA only. "
                "Fix: create the LoraConfig with use_dora=False."
            )
        pair = LoraPair(name, module, adapter, trainable)
        if pair.lora_A.bias is not None or pair.lora_B.bias is not None:
            raise LoraSetupError(
                f"LoRA module {name!r} has a LoRA bias; the rank-r manifold has no bias term. "
                "Fix: create the LoraConfig with lora_bias=False."
            )
        wa, wb = pair.params
        if trainable == "B" and wb.requires_grad and wa.requires_grad:
            raise LoraSetupError(
                f"LoRA module {name!r} has a trainable lora_A, but only lora_B is trained here; its gradient "
                "would escape the privacy guarantee. Fix: call prismdp.lora.freeze_lora_A(model) first."
            )
        if not (wb.requires_grad and (wa.requires_grad or trainable == "B")):
            continue
        m, n, r = pair.shape
        if r >= min(m, n):
            raise LoraSetupError(
                f"LoRA module {name!r} has rank r={r} >= min(out={m}, in={n}): the fixed-rank manifold is "
                "degenerate there. Fix: choose r < min(in_features, out_features) or exclude this module."
            )
        pairs.append(pair)
    if not pairs:
        raise LoraSetupError(
            f"no trainable LoRA Linear pairs for adapter {adapter!r} were found in the model. Fix: wrap the "
            "model with peft.get_peft_model(model, LoraConfig(target_modules=[...])) before building the optimizer."
        )
    return pairs


def stack_by_shape(pairs: list[LoraPair]) -> list[list[int]]:
    """Indices of the pairs with equal (m, n, r, scaling, trained factors, dtype, device), in order of first
    appearance: per-example gradients and PRISM's geometry process each such *stack* as one batched tensor."""
    stacks: dict[tuple, list[int]] = {}
    for k, pair in enumerate(pairs):
        w = pair.lora_A.weight
        stacks.setdefault((pair.shape, pair.scaling, pair.trains_A, w.dtype, w.device), []).append(k)
    return list(stacks.values())


@torch.no_grad()
def get_factors(pair: LoraPair, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(A, B)`` = ``(sqrt(s) W_B, sqrt(s) W_A^T)`` with shapes (m, r), (n, r)."""
    root = math.sqrt(pair.scaling)
    wa, wb = pair.params
    dtype = dtype or wb.dtype
    return wb.to(dtype) * root, wa.T.to(dtype) * root


@torch.no_grad()
def set_factors(pair: LoraPair, A: Tensor, B: Tensor) -> None:
    """Write ``(A, B)`` back into ``(lora_B.weight, lora_A.weight)``."""
    inv_root = 1.0 / math.sqrt(pair.scaling)
    wa, wb = pair.params
    wb.copy_(A * inv_root)
    wa.copy_(B.T * inv_root)

