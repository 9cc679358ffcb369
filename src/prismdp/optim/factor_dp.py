"""Factor-space DP-SGD (the common "DP-LoRA"), with Opacus' DPOptimizer semantics, around any torch optimizer.

Per example, the gradients of every trained tensor (``lora_B.weight`` and, unless the pair's ``lora_A`` is frozen
as in FFA-LoRA, ``lora_A.weight`` of each pair, and the dense parameters) are concatenated, clipped to global L2
norm C, summed, perturbed by ``N(0, sigma^2 C^2)`` on every coordinate and divided by the expected batch size;
the result is written to ``p.grad`` and the wrapped optimizer steps.  With ``AdamW`` this is the paper's DP-AdamW
baseline; :mod:`prismdp.optim.baselines` wraps the other baselines' optimizers the same way.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from ..grad_sample import PerExampleGrads
from ..lora import LoraPair
from ..privacy.clipping import ClippedSum, DPConfig, clipped_sum, contributing, gaussian_like, noise_generator

__all__ = ["DPFactorOptimizer", "dp_adamw"]


class DPFactorOptimizer:
    """Wraps ``optimizer``; ``accumulate()`` per micro-batch, then ``step()`` once per logical batch."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pairs: list[LoraPair],
        dense_params: Iterable[nn.Parameter] = (),
        *,
        dp: DPConfig,
        generator: torch.Generator | None = None,
        budget=None,
    ):
        self.optimizer = optimizer
        self.pairs = list(pairs)
        self.dense_params = list(dense_params)
        self.dp = dp
        self.budget = budget
        self.generator = noise_generator(self.pairs[0].lora_A.weight.device, generator)
        self._clip = ClippedSum(dp.max_grad_norm)
        self._sums: list[Tensor] | None = None
        self._last_clip = None
        covered = {id(p) for p in self._params()}
        stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in covered and p.requires_grad]
        if stray:
            raise ValueError(
                f"the wrapped optimizer updates {len(stray)} tensor(s) that get no per-example clipping or noise; "
                "they would escape the privacy guarantee. Fix: pass them as dense_params or remove them."
            )

    def _params(self) -> list[nn.Parameter]:
        """Trained tensors in the order of :class:`PerExampleGrads`: per pair (lora_B[, lora_A]), then dense."""
        return [p for pair in self.pairs for p in pair.trained_params] + self.dense_params

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def accumulate(self, grads: PerExampleGrads) -> None:
        if grads.batch_size == 0:
            return
        # exactly the trained tensors, in the order of _params(): a frozen lora_A joins neither norm nor sum;
        # lora_A's per-example gradient arrives transposed (n, r)
        tensors: list[tuple[Tensor, bool]] = []
        for pair, (g_wb, g_wa_t) in zip(self.pairs, grads.lora):
            tensors += [(g_wb, False), (g_wa_t, True)] if pair.trains_A else [(g_wb, False)]
        tensors += [(g, False) for g in grads.dense]
        tensors = [(t.float(), transposed) for t, transposed in tensors]
        sq = sum(t.flatten(1).square().sum(1) for t, _ in tensors)
        coef = self._clip.coefficients(sq)
        keep = contributing(coef)
        if self._sums is None:
            self._sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self._params()]
        for s, (t, transposed) in zip(self._sums, tensors):
            summed = clipped_sum(coef, t, keep)
            s.add_(summed.T if transposed else summed)

    @torch.no_grad()
    def step(self, closure=None):
        if self.budget is not None:
            self.budget.check_step()
        params = self._params()
        b = float(self.dp.expected_batch_size)
        std = self.dp.noise_std
        sums = self._sums or [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        for p, s in zip(params, sums):  # an empty Poisson batch releases noise only
            if std > 0:
                s = s + gaussian_like(s, std, self.generator)
            p.grad = (s / b).to(p.dtype)
        loss = self.optimizer.step(closure)
        self._sums = None
        self._last_clip = self._clip.take()
        if self.budget is not None:
            self.budget.record_step()
        return loss

    @property
    def last_stats(self) -> dict[str, float]:
        """Clipping statistics of the last step (reading them synchronises with the device)."""
        return self._last_clip.as_dict() if self._last_clip is not None else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


def dp_adamw(
    pairs: list[LoraPair],
    dense_params: Iterable[nn.Parameter] = (),
    lr: float = 2e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    dp: DPConfig | None,
    generator: torch.Generator | None = None,
    budget=None,
):
    """The DP-AdamW baseline (``dp=None``: plain AdamW on the factors, the non-private LoRA baseline)."""
    dense_params = list(dense_params)
    params = [p for pair in pairs for p in pair.trained_params] + dense_params
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if dp is None:
        return opt
    return DPFactorOptimizer(opt, pairs, dense_params, dp=dp, generator=generator, budget=budget)
