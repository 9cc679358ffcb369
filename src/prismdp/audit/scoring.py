"""The auditor's side of a gradient-canary audit: scores every canary on the released updates.

:class:`GradientScorer` is a step hook (``optimizer.attach_step_hook``): it reads each
:class:`~prismdp.optim.hooks.StepRecord`'s release (what the mechanism published, noise included) and nothing else of
the run.  It knows all m canaries and not which of them were included.
"""

from __future__ import annotations

import numpy as np
import torch

from .canaries import CanarySet, EuclideanLayout, euclidean_units, tangent_parts

__all__ = ["GradientScorer"]


class GradientScorer:
    """Score = inner product of the released updates with each canary's unit direction (see
    :mod:`prismdp.audit.canaries`); :meth:`scores` returns them, one per canary of ``canaries``, in its order."""

    def __init__(self, canaries: CanarySet, device: torch.device | str = "cpu", chunk: int = 256):
        self.canaries, self.chunk, self.steps = canaries, chunk, 0
        self.euclidean = isinstance(canaries.layout, EuclideanLayout)
        self._total: list[torch.Tensor] | None = None  # factor space: the sum of all releases (float64)
        self._scores = torch.zeros(len(canaries), dtype=torch.float64)
        if not self.euclidean:  # PRISM: every canary is scored at every step, so its directions stay in memory
            self._dirs = [d.to(device) for d in canaries.stacked()]

    @torch.no_grad()
    def __call__(self, record) -> None:
        if record.release is None:
            return
        self.steps += 1
        values = record.release.values
        if self.euclidean:
            if self._total is None:
                self._total = [torch.zeros(v.shape, dtype=torch.float64) for v in values]
            for t, v in zip(self._total, values):
                t += v.detach().to("cpu", torch.float64)
            return
        n = len(self.canaries.layout.stacks)
        parts, sq = tangent_parts(self._dirs, record.factors, n)
        score = 0.0
        for i, (u, v, uA, vB) in enumerate(parts):
            dA, dB = values[2 * i], values[2 * i + 1]
            # <dA B^T + A dB^T, u v^T> = (u^T dA)(B^T v) + (u^T A)(dB^T v), summed over the stack's modules and r
            score = score + (torch.einsum("ckm,kmr->ckr", u, dA) * vB).sum((1, 2))
            score = score + (uA * torch.einsum("ckn,knr->ckr", v, dB)).sum((1, 2))
        for d, val in zip(self._dirs[2 * n:], values[2 * n:]):
            score = score + (d.to(val.dtype).flatten(1) @ val.flatten())
        # the canary's unit tangent direction is P(u v^T) / ||P(u v^T)||, and <dZ, P(G)> = <dZ, G> for tangent dZ
        self._scores += (score.double() / sq.double().sqrt()).cpu()

    def scores(self) -> np.ndarray:
        """One score per canary (higher: more likely included)."""
        if not self.euclidean:
            return self._scores.numpy().copy()
        if self._total is None:
            return np.zeros(len(self.canaries))
        out = []
        for start in range(0, len(self.canaries), self.chunk):
            dirs = self.canaries.stacked(range(start, min(start + self.chunk, len(self.canaries))))
            units = euclidean_units([d.double() for d in dirs])
            out.append(sum(u.flatten(1) @ t.flatten() for u, t in zip(units, self._total)))
        return torch.cat(out).numpy()
