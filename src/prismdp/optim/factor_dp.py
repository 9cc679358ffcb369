"""Factor-space DP-SGD (the common "DP-LoRA"), with Opacus' DPOptimizer semantics, around any torch optimizer.

Per example, the gradients of every trained tensor (``lora_B.weight`` and, unless the pair's ``lora_A`` is frozen
as in FFA-LoRA, ``lora_A.weight`` of each pair, and the dense parameters) are concatenated and their global L2 norm
is handed to the :class:`~prismdp.privacy.mechanism.GaussianMechanism`, which clips, sums, adds ``N(0, sigma^2 C^2)``
on every coordinate and divides by the expected batch size; the release is written to ``p.grad`` and the wrapped
optimizer steps.  With ``AdamW`` this is the paper's DP-AdamW baseline; :mod:`prismdp.optim.baselines` wraps the
other baselines' optimizers the same way.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from ..grad_sample import PerExampleGrads
from ..lora import LoraPair
from ..privacy.mechanism import Euclidean, GaussianMechanism, PerExample
from .adam import working_dtype
from .hooks import StepHooks, StepRecord

__all__ = ["DPFactorOptimizer", "dp_adamw"]


class DPFactorOptimizer:
    """Wraps ``optimizer``; ``accumulate()`` per micro-batch, then ``step()`` once per logical batch."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pairs: list[LoraPair],
        dense_params: Iterable[nn.Parameter] = (),
        *,
        mechanism: GaussianMechanism,
    ):
        self.optimizer = optimizer
        self.pairs = list(pairs)
        self.dense_params = list(dense_params)
        self.mechanism = mechanism
        self._hooks = StepHooks()
        # clipped sums and noise in the working dtype: float32 (float64 for a float64 model)
        self.dtype = working_dtype(self.params[0].dtype)
        self.coords = Euclidean([p.shape for p in self.params], self.dtype, [p.device for p in self.params])
        covered = {id(p) for p in self.params}
        stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in covered and p.requires_grad]
        if stray:
            raise ValueError(
                f"the wrapped optimizer updates {len(stray)} tensor(s) that get no per-example clipping or noise; "
                "they would escape the privacy guarantee. Fix: pass them as dense_params or remove them."
            )

    @property
    def params(self) -> list[nn.Parameter]:
        """Trained tensors in the order of :class:`PerExampleGrads`: per pair (lora_B[, lora_A]), then dense."""
        return [p for pair in self.pairs for p in pair.trained_params] + self.dense_params

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def attach_step_hook(self, fn: Callable[[StepRecord], None]):
        """Call ``fn(record)`` after every step; returns a handle with ``remove()``."""
        return self._hooks.attach(fn)

    @torch.no_grad()
    def accumulate(self, grads: PerExampleGrads) -> None:
        if grads.batch_size == 0:
            return
        # exactly the trained tensors, in the order of params: a frozen lora_A joins neither norm nor sum. Read in
        # the sampler's rank-major layout (contiguous): lora_B's as (b, r, m), summed then transposed, lora_A's as
        # (b, r, n), the weight's own shape
        tensors: list[PerExample] = []
        for pair, (g_wb, g_wa_t) in zip(self.pairs, grads.lora):
            tensors.append(PerExample(g_wb.mT.to(self.dtype), transpose=True))
            if pair.trains_A:
                tensors.append(PerExample(g_wa_t.mT.to(self.dtype)))
        tensors += [PerExample(g.to(self.dtype)) for g in grads.dense]
        sq = sum(t.values.flatten(1).square().sum(1) for t in tensors)
        self.mechanism.accumulate(sq, tensors, self.coords)

    @torch.no_grad()
    def step(self, closure=None):
        release = self.mechanism.release(self.coords)
        for p, g in zip(self.params, release.values):  # an empty Poisson batch releases noise only
            p.grad = g.to(p.dtype)
        loss = self.optimizer.step(closure)
        self.last_clip = release.clip
        self._hooks(StepRecord(release))
        return loss

    @property
    def last_stats(self) -> dict[str, float]:
        """Clipping statistics of the last step (reading them synchronises with the device)."""
        clip = getattr(self, "last_clip", None)
        return clip.as_dict() if clip is not None else {}

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
    mechanism: GaussianMechanism | None,
):
    """The DP-AdamW baseline (``mechanism=None``: plain AdamW on the factors, the non-private LoRA baseline)."""
    dense_params = list(dense_params)
    params = [p for pair in pairs for p in pair.trained_params] + dense_params
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if mechanism is None:
        return opt
    return DPFactorOptimizer(opt, pairs, dense_params, mechanism=mechanism)
