"""Gradient canaries (white-box): extra examples whose per-example gradient the auditor chooses.

A canary is a fixed random direction of the trained space.  When it is in the run and in a step's Poisson sample (rate
q, like every example) it contributes, as one more example of that step's clipped sum, a gradient of norm exactly C
(the clipping bound, in the method's own per-example norm) along its direction; the mechanism then adds its noise to
the sum as usual (:meth:`~prismdp.privacy.mechanism.GaussianMechanism.attach_example_source`).  Every canary's score
is the inner product of the released updates with its unit direction: summed over the steps, the score of an included
canary has mean ``(steps in which it was sampled) * C / b`` more than an excluded one's, against noise of standard
deviation ``sigma C / b`` per step -- the most powerful test against the Gaussian mechanism.

Directions, by method (the coordinates of :class:`~prismdp.optim.hooks.StepRecord` releases):

* factor-space methods (DP-AdamW, FFA, ...): a standard normal vector over every trained tensor, normalised; fixed for
  the run, so its score is its inner product with the *total* release.
* PRISM: per LoRA module an ambient rank-one matrix ``u v^T`` (``u``, ``v`` standard normal), plus a standard normal
  vector over the dense parameters.  At each step the canary's gradient is the projection of that matrix onto the
  current tangent space (``P(u v^T)``, what the tangent-space mechanism releases), normalised over all modules to norm
  C; its score adds up the inner products of each step's released tangent vector with that step's unit direction.
  Rank-one directions keep this at O((m + n) r) per module and canary: no m x n matrix is formed.

A :class:`CanarySet` is public (a root seed and a count; canary ``j``'s direction is drawn from a generator seeded by
``(root, j)``).  The trainer gets a :class:`CanaryInjector` built from the included canaries only; the
:class:`~prismdp.audit.scoring` side scores all of them and never sees which were included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ..optim.factor_dp import DPFactorOptimizer
from ..optim.prism import PRISM

__all__ = ["CanarySet", "CanaryInjector", "EuclideanLayout", "TangentLayout", "layout_of"]


@dataclass(frozen=True)
class EuclideanLayout:
    """Release coordinates of a factor-space optimizer: one tensor per trained tensor (``opt.params`` order)."""

    shapes: tuple[tuple[int, ...], ...]

    def draw(self, gen: torch.Generator, dtype: torch.dtype) -> list[Tensor]:
        return [torch.randn(s, generator=gen, dtype=dtype) for s in self.shapes]


@dataclass(frozen=True)
class TangentLayout:
    """Release coordinates of PRISM: per stack of equal-shape modules ``(k, m, n)``, then the dense tensors."""

    stacks: tuple[tuple[int, int, int], ...]
    dense: tuple[tuple[int, ...], ...]

    def draw(self, gen: torch.Generator, dtype: torch.dtype) -> list[Tensor]:
        """``[u_0 (k, m), v_0 (k, n), u_1, v_1, ..., dense_0, ...]``."""
        out = []
        for k, m, n in self.stacks:
            out += [torch.randn(k, m, generator=gen, dtype=dtype), torch.randn(k, n, generator=gen, dtype=dtype)]
        return out + [torch.randn(s, generator=gen, dtype=dtype) for s in self.dense]


def layout_of(optimizer) -> EuclideanLayout | TangentLayout:
    """The canary layout of a private optimizer of prismdp."""
    if isinstance(optimizer, PRISM):
        stacks = tuple((len(idx), *optimizer.pairs[idx[0]].shape[:2]) for idx in optimizer.stacks)
        return TangentLayout(stacks, tuple(tuple(p.shape) for p in optimizer.dense_params))
    if isinstance(optimizer, DPFactorOptimizer):
        return EuclideanLayout(tuple(tuple(p.shape) for p in optimizer.params))
    raise TypeError(f"gradient canaries need a private PRISM or factor-space optimizer, got {type(optimizer).__name__}")


class CanarySet:
    """``indices`` of the canaries ``0..m-1`` of a root seed; each direction is reproducible from ``(root, j)``."""

    def __init__(self, layout, root: int, indices: Sequence[int], dtype: torch.dtype = torch.float32):
        self.layout, self.root, self.indices, self.dtype = layout, int(root), [int(j) for j in indices], dtype

    @classmethod
    def first(cls, layout, root: int, m: int, dtype: torch.dtype = torch.float32) -> CanarySet:
        return cls(layout, root, range(m), dtype)

    def __len__(self) -> int:
        return len(self.indices)

    def subset(self, indices: Sequence[int]) -> CanarySet:
        return CanarySet(self.layout, self.root, indices, self.dtype)

    def direction(self, j: int) -> list[Tensor]:
        """Canary ``j``'s raw (unnormalised) direction tensors, in the layout's order."""
        seed = int(np.random.SeedSequence([self.root, int(j)]).generate_state(1, np.uint64)[0] >> 1)
        return self.layout.draw(torch.Generator().manual_seed(seed), self.dtype)

    def stacked(self, positions: Sequence[int] | None = None) -> list[Tensor]:
        """The directions of the canaries at ``positions`` (default all) stacked along a new leading dimension."""
        chosen = range(len(self.indices)) if positions is None else positions
        per = [self.direction(self.indices[p]) for p in chosen]
        return [torch.stack(ts) for ts in zip(*per)]


# ---------------------------------------------------------------------------------------------- unit directions


def euclidean_units(dirs: list[Tensor]) -> list[Tensor]:
    """(c, *shape) tensors -> the same, each canary normalised to norm 1 over all tensors."""
    sq = sum(d.flatten(1).double().square().sum(1) for d in dirs)
    inv = sq.rsqrt().to(dirs[0].dtype)
    return [d * inv.view(-1, *([1] * (d.dim() - 1))) for d in dirs]


def tangent_parts(dirs: list[Tensor], factors: list[tuple[Tensor, Tensor]], n_stacks: int):
    """Per canary, its tangent direction at the given point in factor-gradient form, and its squared norm.

    ``dirs`` = ``[u_i (c, k, m), v_i (c, k, n) per stack, dense (c, ...)]``; ``factors`` per stack ``(A (k, m, r),
    B (k, n, r))``.  Returns per stack ``(u, v, uA (c, k, r), vB (c, k, r))`` and the (c,) squared norms of
    ``[P(u_i v_i^T) over all modules, dense]``: ``||P(u v^T)||^2 = |u|^2 |Q_B^T v|^2 + |v|^2 |Q_A^T u|^2 -
    |Q_A^T u|^2 |Q_B^T v|^2`` (``Pi_A u`` and ``Pi_B v`` are orthogonal projections).
    """
    parts, sq = [], 0.0
    for i in range(n_stacks):
        u, v = dirs[2 * i], dirs[2 * i + 1]
        A, B = factors[i]
        u, v = u.to(A.dtype), v.to(A.dtype)
        QA, _ = torch.linalg.qr(A)
        QB, _ = torch.linalg.qr(B)
        pu = torch.einsum("ckm,kmr->ckr", u, QA).square().sum(-1)  # |Q_A^T u|^2  (c, k)
        pv = torch.einsum("ckn,knr->ckr", v, QB).square().sum(-1)
        uu, vv = u.square().sum(-1), v.square().sum(-1)
        sq = sq + (uu * pv + vv * pu - pu * pv).sum(-1)
        parts.append((u, v, torch.einsum("ckm,kmr->ckr", u, A), torch.einsum("ckn,knr->ckr", v, B)))
    for d in dirs[2 * n_stacks:]:
        sq = sq + d.flatten(1).to(torch.float64).square().sum(1).to(d.dtype)
    return parts, sq


class CanaryInjector:
    """The trainer's side: an :data:`~prismdp.privacy.mechanism.ExampleSource` that puts each of its canaries into
    each step's sample with probability ``q`` and returns their clipped sum (each of norm exactly ``C``).

    It is given only the included canaries (it cannot tell which canaries were left out) and a generator for the
    per-step sampling (seed it from OS entropy; ``prismdp audit`` does).
    """

    def __init__(self, canaries: CanarySet, sample_rate: float, max_grad_norm: float, generator: torch.Generator):
        self.canaries, self.q, self.C, self.generator = canaries, float(sample_rate), float(max_grad_norm), generator
        self.sampled = 0  # canary-steps so far (a count, not which)

    def __call__(self, coords) -> list[Tensor] | None:
        if len(self.canaries) == 0:
            return None
        u = torch.rand(len(self.canaries), generator=self.generator, dtype=torch.float64)
        chosen = torch.nonzero(u < self.q).flatten().tolist()
        if not chosen:
            return None
        self.sampled += len(chosen)
        dirs = self.canaries.stacked(chosen)
        if isinstance(self.canaries.layout, EuclideanLayout):
            zeros = coords.zeros()
            units = euclidean_units([d.to(z.dtype) for d, z in zip(dirs, zeros)])
            return [self.C * d.sum(0).to(z.device) for d, z in zip(units, zeros)]
        n = len(self.canaries.layout.stacks)
        parts, sq = tangent_parts([d.to(coords.factors[0][0].device) for d in dirs], coords.factors, n)
        w = self.C * sq.rsqrt()  # (c,) each canary scaled to norm C
        out = []
        for u, v, uA, vB in parts:
            # one canary's factor gradients: gA = G B = u (v^T B), gB = G^T A = v (u^T A)
            out += [torch.einsum("c,ckm,ckr->kmr", w, u, vB), torch.einsum("c,ckn,ckr->knr", w, v, uA)]
        zeros = coords.zeros()
        for d, z in zip(dirs[2 * n:], zeros[2 * n:]):
            out.append(torch.einsum("c,c...->...", w.to(z.dtype), d.to(z.dtype)).to(z.device))
        return out
