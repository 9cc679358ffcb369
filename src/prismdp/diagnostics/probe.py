"""Instrumented optimizer steps: what one private step of PRISM or DP-AdamW did to the intrinsic parameters.

A probe performs the step of a :class:`~prismdp.engine.PrivateLoRA` (instead of ``private.step()``) and records

* the clip statistics of the step;
* the realised ``||Z_{t+1} - Z_t||_F`` per module, from the parameters before and after the step;
* the *actual* noise the Gaussian mechanism added in this step, as factor-space noise ``(xi_A, xi_B)`` in the
  ``Z = A B^T`` coordinates of :func:`prismdp.lora.get_factors`, and its intrinsic norm (first order, per unit
  learning rate) at the factors the step started from;
* the same noise after the optimizer's preconditioner ``P^-1/2`` (PRISM: the rank-space right factors
  ``(V + lambda I)^-1/2`` of the step; DP-AdamW: Adam's diagonal ``1 / (sqrt(v_hat) + eps)`` after the step's
  second-moment update), its intrinsic norm, and ``max ||P^-1/2||_2`` over modules ("aggressiveness");
* the Gram stress ``max_l ||M_l^-1/2||_2`` (``M = A^T A``) at the factors the step started from, and the
  gauge statistic ``S = sum_l s_l (m_l ||B_l||^2 + n_l ||A_l||^2)``.

How the noise is isolated (the probe does not change the step):

* PRISM: ``private_release()`` is called twice on the step's clipped sums, once as configured and once with
  ``sigma = 0``; the difference is the noise lift.  The noise generator is rewound before the real step, which
  therefore draws exactly the noise measured.  The preconditioners are recorded from the calls of
  :func:`prismdp.optim.prism.precondition` made by the step itself.
* DP-AdamW: the released gradient ``(sum + noise) / b`` that :class:`~prismdp.optim.factor_dp.DPFactorOptimizer`
  writes to ``.grad`` minus the clipped sum it accumulated.

PEFT's factors are ``Z = s W_B W_A``; in the coordinates ``A = sqrt(s) W_B``, ``B = sqrt(s) W_A^T`` DP-AdamW's
noise (``N(0, tau^2)`` on every entry of ``W_A``, ``W_B``, ``tau = sigma C / b``) is ``xi_A = sqrt(s) xi_WB``,
``xi_B = sqrt(s) xi_WA^T``, so its expected intrinsic energy is ``tau^2 * s (m ||B||^2 + n ||A||^2)``: the
statistic ``S`` includes the LoRA scaling ``s`` (it is the paper's ``S_t`` when ``s = 1``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..lora import get_factors
from ..optim import PRISM, DPFactorOptimizer
from ..privacy.clipping import DPConfig
from . import measures

__all__ = ["StepRecord", "make_probe", "PrismProbe", "FactorAdamProbe", "recording_preconditioners"]


@dataclass
class StepRecord:
    step: int
    batch_size: float  # realised Poisson batch size
    clip_fraction: float
    clip_coef_mean: float
    dz_norm: float  # sum over modules of ||Z_l,t+1 - Z_l,t||_F
    noise_sq: float  # sum over modules of ||N_Z,l||_F^2 (first order, per unit lr)
    precond_noise_sq: float  # the same after P^-1/2
    aggressiveness: float  # max over modules of ||P^-1/2||_2
    gram_stress: float  # max over modules of ||M^-1/2||_2 at the step's start
    S: float  # sum_l s_l (m_l ||B_l||^2 + n_l ||A_l||^2) at the step's start
    dz_per_module: list[float] = dataclasses.field(default_factory=list, repr=False)

    @property
    def amplification(self) -> float:
        """``||P^-1/2 xi||_Z / ||xi||_Z``: how much the preconditioner scales the step's intrinsic noise."""
        return math.sqrt(self.precond_noise_sq / self.noise_sq) if self.noise_sq > 0 else math.nan


def _factors(pairs) -> list[tuple[Tensor, Tensor]]:
    return [get_factors(p, torch.float64) for p in pairs]


def _common(pairs, before, after) -> tuple[list[float], float, float]:
    dz = [measures.delta_z_norm(A1, B1, A0, B0) for (A0, B0), (A1, B1) in zip(before, after)]
    stress = max(measures.gram_stress(A) for A, _ in before)
    S = sum(p.scaling * measures.gauge_statistic(A, B) for p, (A, B) in zip(pairs, before))
    return dz, stress, S


@contextlib.contextmanager
def recording_preconditioners():
    """Record ``(matrix, eigenvalues)`` of every :func:`prismdp.optim.prism.precondition` call in the block.

    PRISM's step calls it twice per pair, in pair order (``P_A`` then ``P_B``)."""
    from ..optim import prism as prism_module

    calls: list[tuple[Tensor, Tensor]] = []
    original = prism_module.precondition

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out)
        return out

    prism_module.precondition = spy
    try:
        yield calls
    finally:
        prism_module.precondition = original


class PrismProbe:
    def __init__(self, private):
        if not isinstance(private.optimizer, PRISM) or private.dp is None:
            raise ValueError("PrismProbe needs a private PRISM run")
        self.private = private
        self.t = 0

    @torch.no_grad()
    def _release_noise(self) -> list[tuple[Tensor, Tensor]]:
        opt = self.private.optimizer
        state = opt.generator.get_state()
        noisy, _ = opt.private_release()
        dp = opt.dp
        opt.dp = DPConfig(0.0, dp.max_grad_norm, dp.expected_batch_size)
        try:
            clean, _ = opt.private_release()
        finally:
            opt.dp = dp
            opt.generator.set_state(state)  # the real step draws the noise measured here
        return [(nA.double() - cA.double(), nB.double() - cB.double()) for (nA, nB), (cA, cB) in zip(noisy, clean)]

    def step(self) -> StepRecord:
        private = self.private
        pairs = private.pairs
        before = _factors(pairs)
        noise = self._release_noise()
        with recording_preconditioners() as calls:
            stats = private.step()
        after = _factors(pairs)
        self.t += 1
        noise_sq = sum(float(measures.lift_sq(A, B, xA, xB)) for (A, B), (xA, xB) in zip(before, noise))
        groups = private.optimizer.groups  # one batched preconditioner call per shape group and factor
        if len(calls) == 2 * len(groups):  # adaptive PRISM
            pre, aggr = 0.0, 0.0
            for gi, g in enumerate(groups):
                (PA, wA), (PB, wB) = calls[2 * gi], calls[2 * gi + 1]
                for j, k in enumerate(g):
                    (A, B), (xA, xB) = before[k], noise[k]
                    pre += float(measures.lift_sq(A, B, xA @ PA[j].double(), xB @ PB[j].double()))
                    aggr = max(aggr, float(torch.cat([wA[j], wB[j]]).min().rsqrt()))
        elif not calls:  # non-adaptive PRISM: P = I
            pre, aggr = noise_sq, 1.0
        else:
            raise RuntimeError(f"expected 2 preconditioner calls per shape group, recorded {len(calls)}")
        dz, stress, S = _common(pairs, before, after)
        return StepRecord(self.t, stats.get("batch_size", math.nan), stats.get("clip_fraction", math.nan),
                          stats.get("clip_coef_mean", math.nan), sum(dz), noise_sq, pre, aggr, stress, S, dz)


class FactorAdamProbe:
    """DP-AdamW (factor-space DP-SGD around torch's Adam/AdamW)."""

    def __init__(self, private):
        opt = private.optimizer
        if not isinstance(opt, DPFactorOptimizer) or not isinstance(opt.optimizer, (torch.optim.Adam,
                                                                                   torch.optim.AdamW)):
            raise ValueError("FactorAdamProbe needs a private DP-AdamW run")
        if any(not p.trains_A for p in private.pairs):
            raise ValueError("FactorAdamProbe needs both LoRA factors trained")
        self.private = private
        self.t = 0

    @torch.no_grad()
    def step(self) -> StepRecord:
        private = self.private
        opt: DPFactorOptimizer = private.optimizer
        pairs = private.pairs
        before = _factors(pairs)
        params = opt._params()  # the trained tensors in the order of its clipped sums
        sums = opt._sums if opt._sums is not None else [torch.zeros_like(p, dtype=torch.float32) for p in params]
        sums = {id(p): s.detach().double().clone() for p, s in zip(params, sums)}
        b = float(opt.dp.expected_batch_size)
        opt.step()  # what PrivateLoRA.step() does for a private run, keeping .grad readable
        stats = dict(opt.last_stats)
        group = opt.param_groups[0]
        beta2, eps = group["betas"][1], group["eps"]
        noise_sq = pre_sq = 0.0
        aggr = 0.0
        for pair, (A, B) in zip(pairs, before):
            root = math.sqrt(pair.scaling)
            wa, wb = pair.params
            xi = {}
            for name, p in (("A", wb), ("B", wa)):
                noise = (p.grad.double() * b - sums[id(p)]) / b  # this step's N(0, tau^2) noise on p
                st = opt.optimizer.state[p]
                inv_root = measures.adam_inverse_root(st["exp_avg_sq"].double(), int(st["step"]), beta2, eps)
                aggr = max(aggr, float(inv_root.max()))
                xi[name] = (noise, noise * inv_root)
            xA, xB = root * xi["A"][0], root * xi["B"][0].T  # (m, r), (n, r) in Z = A B^T coordinates
            pA, pB = root * xi["A"][1], root * xi["B"][1].T
            noise_sq += float(measures.first_order_sq(A, B, xA, xB))
            pre_sq += float(measures.first_order_sq(A, B, pA, pB))
        private.model.zero_grad(set_to_none=True)
        after = _factors(pairs)
        self.t += 1
        dz, stress, S = _common(pairs, before, after)
        return StepRecord(self.t, stats.get("batch_size", math.nan), stats.get("clip_fraction", math.nan),
                          stats.get("clip_coef_mean", math.nan), sum(dz), noise_sq, pre_sq, aggr, stress, S, dz)


def make_probe(private):
    if private.dp is None:
        raise ValueError("the diagnostics measure the DP mechanism; the run must be private")
    if isinstance(private.optimizer, PRISM):
        return PrismProbe(private)
    return FactorAdamProbe(private)
