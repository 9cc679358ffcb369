"""The paper's baselines under the same DP machinery as DP-AdamW (:class:`~prismdp.optim.factor_dp.DPFactorOptimizer`:
per-example global L2 clip over every trained tensor, Gaussian noise on the sum, division by the expected batch
size), each followed by its own optimizer.  ``mechanism=None`` gives the non-private variant: the bare optimizer.

- :func:`dp_ffa` -- FFA-LoRA (Sun et al., ICLR 2024): ``lora_A`` frozen at its random init, AdamW on ``lora_B``.
- :func:`dp_lora_plus` -- LoRA+ (Hayou et al., 2024): AdamW with ``lr(lora_B) = loraplus_ratio * lr(lora_A)``.
- :func:`dp_lamb` -- LAMB (You et al., 2020), :class:`~prismdp.optim.lamb.Lamb`.
- :func:`dp_lora_rite` -- LoRA-RITE (Yen et al., ICLR 2025), :class:`~prismdp.optim.rite.LoraRITE`.

All builders take ``(pairs, dense_params, *, lr, mechanism, **kwargs)``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..lora import LoraPair
from ..privacy.mechanism import GaussianMechanism
from .factor_dp import DPFactorOptimizer, dp_adamw
from .lamb import Lamb
from .rite import LoraRITE

__all__ = ["dp_ffa", "dp_lora_plus", "dp_lamb", "dp_lora_rite"]


def _private(opt, pairs, dense_params, mechanism):
    if mechanism is None:
        return opt
    return DPFactorOptimizer(opt, pairs, dense_params, mechanism=mechanism)


def _lora_params(pairs: list[LoraPair]) -> list[nn.Parameter]:
    return [p for pair in pairs for p in pair.trained_params]


def dp_ffa(pairs: list[LoraPair], dense_params: Iterable[nn.Parameter] = (), *, lr: float = 2e-4,
           mechanism: GaussianMechanism | None, **adamw_kw):
    """FFA-LoRA: DP-AdamW on ``lora_B`` (and the dense parameters) only.

    ``pairs`` must come from ``find_lora_pairs(model, trainable="B")`` after ``freeze_lora_A(model)``, so that the
    frozen ``lora_A`` joins neither the per-example norm nor the noise.
    """
    if any(pair.trains_A for pair in pairs):
        raise ValueError(
            "FFA-LoRA trains lora_B only; got pairs with a trainable lora_A. Fix: prismdp.lora.freeze_lora_A(model), "
            "then find_lora_pairs(model, trainable='B')."
        )
    return dp_adamw(pairs, dense_params, lr=lr, mechanism=mechanism, **adamw_kw)


def dp_lora_plus(pairs: list[LoraPair], dense_params: Iterable[nn.Parameter] = (), *, lr: float = 2e-4,
                 loraplus_ratio: float = 6.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, mechanism: GaussianMechanism | None):
    """LoRA+: AdamW with three groups, ``lora_A`` at ``lr``, ``lora_B`` at ``loraplus_ratio * lr``, dense at ``lr``."""
    if not loraplus_ratio > 0:
        raise ValueError(f"loraplus_ratio must be > 0, got {loraplus_ratio}")
    dense_params = list(dense_params)
    groups = [
        {"params": [pair.lora_A.weight for pair in pairs if pair.trains_A], "lr": lr, "name": "lora_A"},
        {"params": [pair.lora_B.weight for pair in pairs], "lr": lr * loraplus_ratio, "name": "lora_B"},
    ]
    if dense_params:
        groups.append({"params": dense_params, "lr": lr, "name": "dense"})
    groups = [g for g in groups if g["params"]]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return _private(opt, pairs, dense_params, mechanism)


def dp_lamb(pairs: list[LoraPair], dense_params: Iterable[nn.Parameter] = (), *, lr: float = 5e-3,
            mechanism: GaussianMechanism | None, **lamb_kw):
    """LAMB on every trained tensor (each LoRA factor and each dense parameter is one trust-ratio layer)."""
    dense_params = list(dense_params)
    opt = Lamb(_lora_params(pairs) + dense_params, lr=lr, **lamb_kw)
    return _private(opt, pairs, dense_params, mechanism)


def dp_lora_rite(pairs: list[LoraPair], dense_params: Iterable[nn.Parameter] = (), *, lr: float = 2e-4,
                 mechanism: GaussianMechanism | None, **rite_kw):
    """LoRA-RITE after factor-space clipping and noise (the noisy gradient is what RITE preconditions)."""
    dense_params = list(dense_params)
    opt = LoraRITE(pairs, lr=lr, dense_params=dense_params, **rite_kw)
    return _private(opt, pairs, dense_params, mechanism)
