"""Instrumented optimizer steps: what one private step of PRISM or DP-AdamW did to the intrinsic parameters.

A probe performs the step of a :class:`~prismdp.engine.PrivateLoRA` (``private.step()`` itself, observed through the
optimizer's step hook) and records, as a :class:`StepMeasure`:

* the clip statistics of the step;
* the realised ``||Z_{t+1} - Z_t||_F`` per module, from the parameters before and after the step;
* the *actual* noise the Gaussian mechanism added in this step (the step record's ``release.noise``), as
  factor-space noise ``(xi_A, xi_B)`` in the ``Z = A B^T`` coordinates of :func:`prismdp.lora.get_factors`, and its
  intrinsic norm (first order, per unit learning rate) at the factors the step started from;
* the same noise after the optimizer's preconditioner ``P^-1/2`` (PRISM: the rank-space right factors
  ``(V + lambda I)^-1/2`` of the step, from the step record; DP-AdamW: Adam's diagonal ``1 / (sqrt(v_hat) + eps)``
  after the step's second-moment update), its intrinsic norm, and ``max ||P^-1/2||_2`` over modules
  ("aggressiveness");
* the Gram stress ``max_l ||M_l^-1/2||_2`` (``M = A^T A``) at the factors the step started from, and the
  gauge statistic ``S = sum_l s_l (m_l ||B_l||^2 + n_l ||A_l||^2)``.

PEFT's factors are ``Z = s W_B W_A``; in the coordinates ``A = sqrt(s) W_B``, ``B = sqrt(s) W_A^T`` DP-AdamW's
noise (``N(0, tau^2)`` on every entry of ``W_A``, ``W_B``, ``tau = sigma C / b``) is ``xi_A = sqrt(s) xi_WB``,
``xi_B = sqrt(s) xi_WA^T``, so its expected intrinsic energy is ``tau^2 * s (m ||B||^2 + n ||A||^2)``: the
statistic ``S`` includes the LoRA scaling ``s`` (it is the paper's ``S_t`` when ``s = 1``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..lora import get_factors
from ..optim import PRISM, DPFactorOptimizer
from . import measures

__all__ = ["StepMeasure", "make_probe", "PrismProbe", "FactorAdamProbe"]


@dataclass
class StepMeasure:
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


class _Probe:
    """Keeps the optimizer's last step record (through its step hook)."""

    def __init__(self, private):
        self.private = private
        self.t = 0
        self.record = None
        private.optimizer.attach_step_hook(self._keep)

    def _keep(self, record) -> None:
        self.record = record


class PrismProbe(_Probe):
    def __init__(self, private):
        if not isinstance(private.optimizer, PRISM) or private.dp is None:
            raise ValueError("PrismProbe needs a private PRISM run")
        super().__init__(private)

    def step(self) -> StepMeasure:
        private = self.private
        opt = private.optimizer
        pairs = private.pairs
        before = _factors(pairs)
        stats = private.step()
        after = _factors(pairs)
        self.t += 1
        rec, b = self.record, private.dp.expected_batch_size
        n = 2 * len(rec.stacks)
        noise = [(xA.double() / b, xB.double() / b) for xA, xB in opt.per_pair(rec.release.noise[:n])]
        noise_sq = sum(float(measures.lift_sq(A, B, xA, xB)) for (A, B), (xA, xB) in zip(before, noise))
        if rec.preconditioners is not None:  # adaptive PRISM: one batched preconditioner per stack and factor
            pre, aggr = 0.0, 0.0
            for idx, (PA, wA, PB, wB) in zip(rec.stacks, rec.preconditioners):
                for j, k in enumerate(idx):
                    (A, B), (xA, xB) = before[k], noise[k]
                    pre += float(measures.lift_sq(A, B, xA @ PA[j].double(), xB @ PB[j].double()))
                    aggr = max(aggr, float(torch.cat([wA[j], wB[j]]).min().rsqrt()))
        else:  # non-adaptive PRISM: P = I
            pre, aggr = noise_sq, 1.0
        dz, stress, S = _common(pairs, before, after)
        return StepMeasure(self.t, stats.get("batch_size", math.nan), stats.get("clip_fraction", math.nan),
                           stats.get("clip_coef_mean", math.nan), sum(dz), noise_sq, pre, aggr, stress, S, dz)


class FactorAdamProbe(_Probe):
    """DP-AdamW (factor-space DP-SGD around torch's Adam/AdamW)."""

    def __init__(self, private):
        opt = private.optimizer
        if not isinstance(opt, DPFactorOptimizer) or not isinstance(opt.optimizer, (torch.optim.Adam,
                                                                                   torch.optim.AdamW)):
            raise ValueError("FactorAdamProbe needs a private DP-AdamW run")
        if any(not p.trains_A for p in private.pairs):
            raise ValueError("FactorAdamProbe needs both LoRA factors trained")
        super().__init__(private)

    @torch.no_grad()
    def step(self) -> StepMeasure:
        private = self.private
        opt: DPFactorOptimizer = private.optimizer
        pairs = private.pairs
        before = _factors(pairs)
        b = float(private.dp.expected_batch_size)
        stats = private.step()
        # this step's N(0, tau^2) noise per trained tensor, in the order of opt.params
        released_noise = {id(p): x.double() / b for p, x in zip(opt.params, self.record.release.noise)}
        group = opt.param_groups[0]
        beta2, eps = group["betas"][1], group["eps"]
        noise_sq = pre_sq = 0.0
        aggr = 0.0
        for pair, (A, B) in zip(pairs, before):
            root = math.sqrt(pair.scaling)
            wa, wb = pair.params
            xi = {}
            for name, p in (("A", wb), ("B", wa)):
                noise = released_noise[id(p)]
                st = opt.optimizer.state[p]
                inv_root = measures.adam_inverse_root(st["exp_avg_sq"].double(), int(st["step"]), beta2, eps)
                aggr = max(aggr, float(inv_root.max()))
                xi[name] = (noise, noise * inv_root)
            xA, xB = root * xi["A"][0], root * xi["B"][0].T  # (m, r), (n, r) in Z = A B^T coordinates
            pA, pB = root * xi["A"][1], root * xi["B"][1].T
            noise_sq += float(measures.first_order_sq(A, B, xA, xB))
            pre_sq += float(measures.first_order_sq(A, B, pA, pB))
        after = _factors(pairs)
        self.t += 1
        dz, stress, S = _common(pairs, before, after)
        return StepMeasure(self.t, stats.get("batch_size", math.nan), stats.get("clip_fraction", math.nan),
                          stats.get("clip_coef_mean", math.nan), sum(dz), noise_sq, pre_sq, aggr, stress, S, dz)


def make_probe(private):
    if private.dp is None:
        raise ValueError("the diagnostics measure the DP mechanism; the run must be private")
    if isinstance(private.optimizer, PRISM):
        return PrismProbe(private)
    return FactorAdamProbe(private)
