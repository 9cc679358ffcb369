"""The PRISM optimizer (Algorithm 1 of the paper), torch.optim-style.

One private step is a pipeline::

    accumulate(per-example grads)   per micro-batch: factor grads -> intrinsic norms (all modules + dense)
                                    -> one global clip coefficient per example -> clipped *factor-gradient* sums
    step()                          lift the clipped sums (the lift is linear) -> + tangent noise sigma C Xi
                                    -> / expected batch size -> rank-space adaptive direction -> retraction

Everything after the noise is post-processing of the Gaussian mechanism on the direct sum of the modules'
tangent spaces (plus the dense parameters), so one accountant covers everything trained.  Without a
:class:`~prismdp.privacy.clipping.DPConfig` the optimizer is non-private: ``step()`` reads ``p.grad`` like any
torch optimizer and applies the same geometry (lift, adaptive step, retraction) without clipping or noise.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor, nn

from .. import geometry
from ..grad_sample import PerExampleGrads
from ..lora import LoraPair, LoraSetupError, get_factors, set_factors, shape_groups
from .adam import adam_direction, check_lr_betas, working_dtype
from ..privacy.clipping import ClippedSum, DPConfig, clipped_sum, contributing, gaussian_like, noise_generator

__all__ = ["PRISM", "precondition"]


def precondition(
    V: Tensor, floor: Tensor | float, eps: float, cond_max: float | None
) -> tuple[Tensor, Tensor]:
    """``(V + floor I)^-1/2`` for a symmetric (r, r) ``V``, with eigenvalues clipped at 0 before the floor
    and small eigenvalues raised to ``max / cond_max`` (a condition-number clamp).  Returns the matrix and
    the clamped eigenvalues (for diagnostics)."""
    w, Q = torch.linalg.eigh(0.5 * (V + V.mT))
    w = w.clamp_min(0.0) + floor + eps
    if cond_max is not None:
        w = torch.maximum(w, w.amax(-1, keepdim=True) / cond_max)
    return (Q * w.rsqrt().unsqueeze(-2)) @ Q.mT, w


class PRISM(torch.optim.Optimizer):
    """PRISM: DP-SGD on the intrinsic LoRA updates ``Z = A B^T`` with a DP-aware rank-space adaptive step.

    Args:
        pairs: the LoRA pairs to train (``prismdp.lora.find_lora_pairs``); they must already be on the rank-r
            manifold (``prismdp.lora.move_to_rank_r_start``).  Their factors are re-balanced here (Z unchanged),
            which makes the whole trajectory gauge-invariant from step 0.
        lr: learning rate of the retraction step (and of the dense parameters' Adam step).
        betas, eps: moment decay rates and the additive eigenvalue epsilon.
        dense_params: other trainable parameters (e.g. a classification head); they join the global per-example
            norm, get Euclidean noise of the same sigma and an Adam step.
        dp: the Gaussian mechanism's constants; ``None`` for the non-private optimizer.
        generator: the noise source; ``None`` draws a fresh seed from the OS (use a seeded generator only for
            reproducible experiments).
        budget: optional privacy budget with ``check_step()`` / ``record_step()``; a step that would exceed it is
            refused before any noise is drawn.
        adaptive: rank-space Adam (Eqs. adam_moments-noise_floor); ``False`` gives plain Riemannian SGD.
        floor_factor: multiplier of the DP-aware floors (Eq. noise_floor).
        cond_max: condition-number clamp of the preconditioner (``None`` disables it).
        debias_second_moment: subtract the known noise covariance from the second moments (Appendix A.26).
    """

    def __init__(
        self,
        pairs: list[LoraPair],
        lr: float = 2e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        dense_params: Iterable[nn.Parameter] = (),
        dp: DPConfig | None = None,
        generator: torch.Generator | None = None,
        budget=None,
        adaptive: bool = True,
        floor_factor: float = 1.0,
        cond_max: float | None = 1e4,
        debias_second_moment: bool = True,
    ):
        check_lr_betas(lr, betas)
        dense_params = list(dense_params)
        groups = [{"params": [p for pair in pairs for p in pair.params], "kind": "lora"}]
        if dense_params:
            groups.append({"params": dense_params, "kind": "dense"})
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps))
        self.pairs = list(pairs)
        self.dense_params = dense_params
        self.dp = dp
        self.budget = budget
        self.adaptive = adaptive
        self.floor_factor = floor_factor
        self.cond_max = cond_max
        self.debias_second_moment = debias_second_moment
        self.generator = noise_generator(self.pairs[0].lora_A.weight.device, generator)
        self._clip = ClippedSum(dp.max_grad_norm) if dp is not None else None
        self._last_clip = None
        self.groups = shape_groups(self.pairs)
        # working dtype: float32 for float32/bf16/fp16 weights, float64 for float64 ones
        self.dtype = working_dtype(self.pairs[0].lora_A.weight.dtype)
        self._frames: list[geometry.Frame] | None = None  # per group, stacked
        self._factors: list[tuple[Tensor, Tensor]] | None = None  # per group, stacked
        self._acc: list[list[Tensor]] | None = None  # [group sums (gA, gB)..., dense sums...]
        self._balance_factors()

    # ------------------------------------------------------------------ setup

    @torch.no_grad()
    def _balance_factors(self) -> None:
        for pair in self.pairs:
            A, B = get_factors(pair, torch.float64)
            fr = geometry.frame(A, B)
            s = torch.linalg.svdvals(fr.RA @ fr.RB.mT)
            if not bool(torch.isfinite(s).all()) or float(s[-1]) <= 1e-12 * max(float(s[0]), 1e-300):
                raise LoraSetupError(
                    f"LoRA module {pair.name!r} is not a rank-{pair.shape[2]} point (PEFT's zero-initialised "
                    "lora_B puts Z at 0, off the manifold). Fix: call prismdp.lora.move_to_rank_r_start(pairs) "
                    "before creating the PRISM optimizer."
                )
            A, B = geometry.balance(A, B)
            set_factors(pair, A, B)

    def _stacked_factors(self, g: list[int]) -> tuple[Tensor, Tensor]:
        """``(A, B)`` of the group's pairs stacked: (k, m, r), (k, n, r), in the working dtype."""
        root = math.sqrt(self.pairs[g[0]].scaling)
        A = torch.stack([self.pairs[k].lora_B.weight for k in g]).to(self.dtype) * root
        B = torch.stack([self.pairs[k].lora_A.weight for k in g]).to(self.dtype).mT * root
        return A, B

    def _set_stacked_factors(self, g: list[int], A: Tensor, B: Tensor) -> None:
        inv_root = 1.0 / math.sqrt(self.pairs[g[0]].scaling)
        WB, WA = A * inv_root, (B.mT * inv_root).contiguous()  # one batched transpose, then contiguous copies
        for j, k in enumerate(g):
            wa, wb = self.pairs[k].params
            wb.copy_(WB[j])
            wa.copy_(WA[j])

    def _ensure_frames(self) -> list[geometry.Frame]:
        """Per shape group: the stacked factors and their QR frames, computed once per step and reused by every
        micro-batch."""
        if self._frames is None:
            self._factors = [self._stacked_factors(g) for g in self.groups]
            self._frames = [geometry.frame(A, B) for A, B in self._factors]
        return self._frames

    def _zero_sums(self) -> list[list[Tensor]]:
        sums = [[torch.zeros_like(A), torch.zeros_like(B)] for A, B in self._factors]
        return sums + [[torch.zeros(p.shape, dtype=self.dtype, device=p.device)] for p in self.dense_params]

    def _stack_grads(self, g: list[int], per_pair) -> tuple[Tensor, Tensor]:
        """Parameter-space gradients of the group's pairs stacked along a new leading dim, unscaled (see
        :meth:`_inv_root`): ``(G B, G^T A) * sqrt(s)``."""
        return tuple(torch.stack([per_pair[k][part] for k in g]).to(self.dtype) for part in (0, 1))

    def _inv_root(self, g: list[int]) -> float:
        """Parameter-space factor gradients times this are the intrinsic ``(gA, gB) = (G B, G^T A)``."""
        return 1.0 / math.sqrt(self.pairs[g[0]].scaling)

    def _group_grads(self, grads: PerExampleGrads) -> list[tuple[Tensor, Tensor]]:
        """Per group (k, b, m, r) / (k, b, n, r) per-example factor gradients (unscaled): the sampler's own
        stacks when it grouped the pairs as this optimizer does, else stacked here."""
        if grads.grouped is not None and grads.groups == self.groups:
            return [(gb.to(self.dtype), ga.to(self.dtype)) for gb, ga in grads.grouped]
        return [self._stack_grads(g, grads.lora) for g in self.groups]

    # ------------------------------------------------------------------ private accumulation

    @torch.no_grad()
    def accumulate(self, grads: PerExampleGrads) -> None:
        """Clip one micro-batch of per-example gradients (one global intrinsic norm) and add them to the sums.

        Modules of equal shape are processed as one batch: (k, b, m, r) per-example factor gradients (written there
        by the gradient sampler), r x r Gram matrices for the norms and one reduction per group; the only read from
        the device is :func:`~prismdp.privacy.clipping.contributing`'s, once per micro-batch and on the CPU only.
        """
        if self.dp is None:
            raise RuntimeError("accumulate() is for the private optimizer; the non-private one reads p.grad in step()")
        if grads.batch_size == 0:
            return
        frames = self._ensure_frames()
        if self._acc is None:
            self._acc = self._zero_sums()
        group_grads = self._group_grads(grads)  # (k, b, m, r), (k, b, n, r), still to be scaled by inv_root
        sq = torch.zeros(grads.batch_size, dtype=self.dtype, device=frames[0].QA.device)
        for g, fr, (gA, gB) in zip(self.groups, frames, group_grads):
            per_batch = geometry.Frame(*(t.unsqueeze(1) for t in fr))  # (k, 1, ., r) broadcasts over examples
            sq = sq + self._inv_root(g) ** 2 * geometry.projected_grad_norm_sq_balanced(per_batch, gA, gB).sum(0)
        dense = [g.to(self.dtype) for g in grads.dense]
        for g in dense:
            sq = sq + g.flatten(1).square().sum(1)
        coef = self._clip.coefficients(sq)
        keep = contributing(coef)
        for g, acc, (gA, gB) in zip(self.groups, self._acc, group_grads):
            inv_root = self._inv_root(g)
            acc[0].add_(clipped_sum(coef, gA, keep, dim=1), alpha=inv_root)
            acc[1].add_(clipped_sum(coef, gB, keep, dim=1), alpha=inv_root)
        for (acc,), g in zip(self._acc[len(self.groups):], dense):
            acc.add_(clipped_sum(coef, g, keep))

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.dp is not None:
            if self.budget is not None:
                self.budget.check_step()
            self._private_step()
            if self.budget is not None:
                self.budget.record_step()
        else:
            self._nonprivate_step()
        self._frames, self._factors, self._acc = None, None, None
        return loss

    @property
    def last_stats(self) -> dict[str, float]:
        """Clipping statistics of the last private step (reading them synchronises with the device)."""
        return self._last_clip.as_dict() if self._last_clip is not None else {}

    @torch.no_grad()
    def _release_groups(self) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
        """:meth:`private_release` per shape group: stacked (k, m, r) / (k, n, r) lifts."""
        dp = self.dp
        if dp is None:
            raise RuntimeError("private_release() needs a DPConfig")
        frames = self._ensure_frames()
        b = float(dp.expected_batch_size)
        std = dp.noise_std
        acc = self._acc if self._acc is not None else self._zero_sums()  # empty Poisson batch: noise only
        lora = []
        for fr, (gA_sum, gB_sum) in zip(frames, acc):
            dA, dB = geometry.lift_with_frame(fr, gA_sum, gB_sum)
            if std > 0:
                xi_A, xi_B = geometry.noise_with_frame(
                    fr, gaussian_like(fr.QA, 1.0, self.generator), gaussian_like(fr.QB, 1.0, self.generator)
                )
                dA, dB = dA + std * xi_A, dB + std * xi_B
            lora.append((dA / b, dB / b))
        dense = []
        for (s,) in acc[len(self.groups):]:
            dense.append((s + gaussian_like(s, std, self.generator) if std > 0 else s) / b)
        return lora, dense

    @torch.no_grad()
    def private_release(self) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
        """The Gaussian mechanism's output for this logical batch (Eq. dp_tangent_noise).

        Per pair the lift ``(dA_dp, dB_dp)`` of ``(sum_i alpha_i P(G_i) + sigma C P(Xi)) / b`` and per dense
        parameter ``(sum_i alpha_i g_i + sigma C xi) / b``, with ``b`` the expected batch size.  Everything the
        optimizer does afterwards is post-processing of this release.
        """
        groups, dense = self._release_groups()
        lora: list = [None] * len(self.pairs)
        for g, (dA, dB) in zip(self.groups, groups):
            for j, k in enumerate(g):
                lora[k] = (dA[j], dB[j])
        return lora, dense

    def _private_step(self) -> None:
        lora, dense = self._release_groups()
        tau = self.dp.noise_std / float(self.dp.expected_batch_size)  # per-dimension std of the released noise
        for gi, (dA, dB) in enumerate(lora):
            self._update_group(gi, dA, dB, tau)
        self._dense_step(dense)
        self._last_clip = self._clip.take()

    def _nonprivate_step(self) -> None:
        frames = self._ensure_frames()
        grads = []
        for pair in self.pairs:
            wa, wb = pair.params
            grads.append(None if wa.grad is None and wb.grad is None else (
                wb.grad if wb.grad is not None else torch.zeros_like(wb),
                (wa.grad if wa.grad is not None else torch.zeros_like(wa)).T))
        for gi, (g, fr) in enumerate(zip(self.groups, frames)):
            if all(grads[k] is None for k in g):
                continue
            filled = {k: grads[k] if grads[k] is not None else (torch.zeros_like(self.pairs[k].lora_B.weight),
                                                                  torch.zeros_like(self.pairs[k].lora_A.weight).T)
                      for k in g}
            gA, gB = self._stack_grads(g, filled)
            inv_root = self._inv_root(g)
            dA, dB = geometry.lift_with_frame(fr, gA * inv_root, gB * inv_root)
            self._update_group(gi, dA, dB, 0.0)
        self._dense_step([p.grad.to(self.dtype) if p.grad is not None else None for p in self.dense_params])

    def _update_group(self, gi: int, dA: Tensor, dB: Tensor, tau: float) -> None:
        """Adaptive direction from the (noisy) tangent update, then retraction and Procrustes alignment, for the
        stacked pairs of one shape group."""
        fr, (A, B) = self._frames[gi], self._factors[gi]
        lr = self.param_groups[0]["lr"]
        UA, UB = self._adaptive_direction(gi, fr, dA, dB, tau) if self.adaptive else (dA, dB)
        A_new, B_new = geometry.retract(A, B, UA, UB, lr)
        A_new, B_new = geometry.procrustes_align(A_new, B_new, A, B)
        self._set_stacked_factors(self.groups[gi], A_new, B_new)

    def _adaptive_direction(self, gi, fr, dA, dB, tau):
        beta1, beta2 = self.param_groups[0]["betas"]
        eps = self.param_groups[0]["eps"]
        g = self.groups[gi]
        m, n, r = self.pairs[g[0]].shape
        st = self.state[self.pairs[g[0]].lora_A.weight]  # the group's state lives on its first pair
        if not st:
            st["step"] = 0
            st["mA"], st["mB"] = torch.zeros_like(dA), torch.zeros_like(dB)
            st["VA"] = torch.zeros(len(g), r, r, dtype=torch.float64, device=dA.device)
            st["VB"] = torch.zeros(len(g), r, r, dtype=torch.float64, device=dA.device)
        st["step"] += 1
        t = st["step"]
        st["mA"].mul_(beta1).add_(dA, alpha=1 - beta1)
        st["mB"].mul_(beta1).add_(dB, alpha=1 - beta1)
        dA64, dB64 = dA.double(), dB.double()
        st["VA"].mul_(beta2).add_(dA64.mT @ dA64 / m, alpha=1 - beta2)
        st["VB"].mul_(beta2).add_(dB64.mT @ dB64 / n, alpha=1 - beta2)
        VA = st["VA"] / (1 - beta2**t)
        VB = st["VB"] / (1 - beta2**t)
        floor_A = floor_B = 0.0
        if tau > 0:
            eye = torch.eye(r, dtype=torch.float64, device=dA.device)
            inv_RA = torch.linalg.solve_triangular(fr.RA.double(), eye, upper=True)
            inv_RB = torch.linalg.solve_triangular(fr.RB.double(), eye, upper=True)
            M_inv, N_inv = inv_RA @ inv_RA.mT, inv_RB @ inv_RB.mT
            noise_A = tau**2 * (m - r) / m * N_inv  # E[Xi_A^T Xi_A / m] tau^2
            noise_B = tau**2 * M_inv  # E[Xi_B^T Xi_B / n] tau^2
            if self.debias_second_moment:
                VA, VB = VA - noise_A, VB - noise_B
            floor_A = self.floor_factor * noise_A.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / r
            floor_B = self.floor_factor * noise_B.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / r
        PA, wA = precondition(VA, floor_A, eps, self.cond_max)
        PB, wB = precondition(VB, floor_B, eps, self.cond_max)
        bc1 = 1 - beta1**t
        return (st["mA"] / bc1) @ PA.to(dA.dtype), (st["mB"] / bc1) @ PB.to(dB.dtype)

    def _dense_step(self, grads: list[Tensor | None]) -> None:
        """Adam on the dense parameters (Euclidean geometry)."""
        if not self.dense_params:
            return
        group = self.param_groups[1]
        for p, g in zip(self.dense_params, grads):
            if g is not None:
                p.add_(adam_direction(self.state[p], g, group["betas"], group["eps"]).to(p.dtype), alpha=-group["lr"])
