"""The PRISM optimizer (Algorithm 1 of the paper), torch.optim-style.

One private step is a pipeline::

    accumulate(per-example grads)   per micro-batch: factor grads -> intrinsic norms (all modules + dense)
                                    -> mechanism: one global clip coefficient per example, clipped factor-gradient sums
    step()                          mechanism.release: lift the clipped sums (the lift is linear) + tangent noise
                                    sigma C Xi, / expected batch size -> rank-space adaptive direction -> retraction

Everything after the release is post-processing of the Gaussian mechanism on the direct sum of the modules'
tangent spaces (plus the dense parameters), so one accountant covers everything trained.  Without a
:class:`~prismdp.privacy.mechanism.GaussianMechanism` the optimizer is non-private: ``step()`` reads ``p.grad`` like
any torch optimizer and applies the same geometry (lift, adaptive step, retraction) without clipping or noise.

Modules of equal shape are processed as one *stack* (``self.stacks``: lists of pair indices): (k, m, r) factors,
(k, b, m, r) per-example gradients.  The stacks' updates run in lockstep, so each of the step's factorisations (the
preconditioner's eigendecomposition, the retraction's and the alignment's SVDs, all of r x r or 2r x 2r matrices) is
one batched call for all stacks (:mod:`prismdp.optim.factorise`): on CUDA each call reads its status on the host.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from .. import geometry
from ..grad_sample import PerExampleGrads
from .. import lora
from ..lora import LoraPair, LoraSetupError, get_factors, set_factors
from ..privacy.mechanism import GaussianMechanism, PerExample
from .adam import KeepStateDtypes, adam_direction, check_lr_betas, working_dtype
from . import factorise
from .adaptive import AdaptiveOptions, direction_from_eig, moments
from .hooks import StepHooks, StepRecord

__all__ = ["PRISM"]


class _TangentCoordinates:
    """PRISM's coordinates for the mechanism (one step): per stack the clipped factor-gradient sums
    ``(sum alpha_i G_i B, sum alpha_i G_i^T A)`` lifted canonically, and isotropic tangent noise; dense parameters
    Euclidean.  Sums are ordered ``[gA_0, gB_0, gA_1, gB_1, ..., dense_0, ...]``."""

    def __init__(self, frames: list[geometry.Frame], factors: list[tuple[Tensor, Tensor]],
                 dense_params: list[nn.Parameter], dtype: torch.dtype):
        self.frames, self.factors, self.dense_params, self.dtype = frames, factors, dense_params, dtype

    def zeros(self) -> list[Tensor]:
        sums = [z for A, B in self.factors for z in (torch.zeros_like(A), torch.zeros_like(B))]
        return sums + [torch.zeros(p.shape, dtype=self.dtype, device=p.device) for p in self.dense_params]

    def _map(self, fn, tensors: list[Tensor]) -> list[Tensor]:
        out = []
        for i, fr in enumerate(self.frames):
            out += fn(fr, tensors[2 * i], tensors[2 * i + 1])
        return out + tensors[2 * len(self.frames):]

    def signal(self, sums: list[Tensor]) -> list[Tensor]:
        return self._map(geometry.lift_with_frame, sums)

    def noise(self, draws: list[Tensor]) -> list[Tensor]:
        return self._map(geometry.noise_with_frame, draws)


def _horizontal_lift(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, fr: geometry.Frame) -> factorise.Update:
    """:func:`prismdp.geometry.horizontal_lift`, its eigendecomposition yielded (see :meth:`PRISM._update_stack`)."""
    MN, rhs = geometry.horizontal_lift_system(A, B, dA, dB, fr)
    return geometry.horizontal_lift_solve(A, B, dA, dB, (yield "eigh", MN), rhs)


def _qr_norm_sq(fr: geometry.Frame, gA_t: Tensor, gB_t: Tensor) -> Tensor:
    """(k, b) per-example norms by triangular solves (:func:`prismdp.geometry.projected_grad_norm_sq`), from rank-major
    gradients; the frame broadcasts over the examples."""
    return geometry.projected_grad_norm_sq(geometry.Frame(*(t.unsqueeze(1) for t in fr)), gA_t.mT, gB_t.mT)


class PRISM(KeepStateDtypes, torch.optim.Optimizer):
    """PRISM: DP-SGD on the intrinsic LoRA updates ``Z = A B^T`` with a DP-aware rank-space adaptive step.

    Args:
        pairs: the LoRA pairs to train (``prismdp.lora.find_lora_pairs``); they must already be on the rank-r
            manifold (``prismdp.lora.move_to_rank_r_start``).  Their factors are re-balanced here (Z unchanged),
            which makes the whole trajectory gauge-invariant from step 0.
        lr: learning rate of the retraction step (and of the dense parameters' Adam step).
        betas, eps: moment decay rates and the additive eigenvalue epsilon.
        dense_params: other trainable parameters (e.g. a classification head); they join the global per-example
            norm, get Euclidean noise of the same sigma and an Adam step.
        mechanism: the Gaussian mechanism (clipping, noise, budget); ``None`` for the non-private optimizer.
        adaptive: rank-space Adam (Eqs. adam_moments-noise_floor); ``False`` gives plain Riemannian SGD.
        preset: the adaptive step's variant (:data:`prismdp.optim.adaptive.PRESETS`: ``paper``, ``reference``);
            ``floor_mode``, ``floor_factor``, ``debias``, ``horizontal_lift`` and ``cond_max`` (``inf`` disables
            the condition clamp) override single options of it (:class:`~prismdp.optim.adaptive.AdaptiveOptions`).
        stack_by_shape: process modules of equal shape as one stacked batch (``False``: one module at a time; the
            same math, for benchmarks).
        norms: per-example norms from r x r Gram matrices at the balanced factors (``"gram"``) or by triangular
            solves (``"qr"``, :func:`prismdp.geometry.projected_grad_norm_sq`; for benchmarks).
        qr: the thin QR of the step's frames and retraction, one of :data:`prismdp.geometry.QR_METHODS`
            (``None``: by device and dtype, :func:`prismdp.geometry.default_qr`: shifted CholeskyQR2 on CUDA,
            Householder on the CPU).
    """

    def __init__(
        self,
        pairs: list[LoraPair],
        lr: float = 2e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        dense_params: Iterable[nn.Parameter] = (),
        mechanism: GaussianMechanism | None = None,
        adaptive: bool = True,
        preset: str = "paper",
        floor_mode: str | None = None,
        floor_factor: float | None = None,
        debias: bool | None = None,
        horizontal_lift: str | None = None,
        cond_max: float | None = None,
        stack_by_shape: bool = True,
        norms: str = "gram",
        qr: str | None = None,
    ):
        check_lr_betas(lr, betas)
        if norms not in ("gram", "qr"):
            raise ValueError(f"norms must be 'gram' or 'qr', got {norms!r}")
        if qr is not None and qr not in geometry.QR_METHODS:
            raise ValueError(f"qr must be one of {geometry.QR_METHODS} or None (by device), got {qr!r}")
        dense_params = list(dense_params)
        param_groups = [{"params": [p for pair in pairs for p in pair.params], "kind": "lora"}]
        if dense_params:
            param_groups.append({"params": dense_params, "kind": "dense"})
        super().__init__(param_groups, dict(lr=lr, betas=tuple(betas), eps=eps))
        self.pairs = list(pairs)
        self.dense_params = dense_params
        self.mechanism = mechanism
        self.adaptive = adaptive
        self.options = AdaptiveOptions.from_preset(preset, floor_mode=floor_mode, floor_factor=floor_factor,
                                                   debias=debias, horizontal_lift=horizontal_lift, cond_max=cond_max)
        self._norm_sq = geometry.per_example_norm_sq_balanced if norms == "gram" else _qr_norm_sq
        self.qr = qr
        self.stacks = lora.stack_by_shape(self.pairs) if stack_by_shape else [[k] for k in range(len(self.pairs))]
        self._hooks = StepHooks()
        self.last_clip = None
        # working dtype: float32 for float32/bf16/fp16 weights, float64 for float64 ones
        self.dtype = working_dtype(self.pairs[0].lora_A.weight.dtype)
        self._frames: list[geometry.Frame] | None = None  # per stack
        self._factors: list[tuple[Tensor, Tensor]] | None = None  # per stack
        self._balance_factors()

    # ------------------------------------------------------------------ setup

    @torch.no_grad()
    def _balance_factors(self) -> None:
        for pair in self.pairs:
            A, B = get_factors(pair, torch.float64)
            # Householder: a zero factor (PEFT's lora_B) gives an exactly zero R here, where CholeskyQR's shift would
            # leave a tiny one
            fr = geometry.frame(A, B, "householder")
            s = torch.linalg.svdvals(fr.RA @ fr.RB.mT)
            if not bool(torch.isfinite(s).all()) or float(s[-1]) <= 1e-12 * max(float(s[0]), 1e-300):
                raise LoraSetupError(
                    f"LoRA module {pair.name!r} is not a rank-{pair.shape[2]} point (PEFT's zero-initialised "
                    "lora_B puts Z at 0, off the manifold). Fix: call prismdp.lora.move_to_rank_r_start(pairs) "
                    "before creating the PRISM optimizer."
                )
            A, B = geometry.balance(A, B, "householder")
            set_factors(pair, A, B)

    def attach_step_hook(self, fn: Callable[[StepRecord], None]):
        """Call ``fn(record)`` after every step (:class:`~prismdp.optim.hooks.StepRecord`); returns a handle with
        ``remove()``."""
        return self._hooks.attach(fn)

    def _stacked_factors(self, idx: list[int]) -> tuple[Tensor, Tensor]:
        """``(A, B)`` of the stack's pairs: (k, m, r), (k, n, r), in the working dtype."""
        root = math.sqrt(self.pairs[idx[0]].scaling)
        A = torch.stack([self.pairs[k].lora_B.weight for k in idx]).to(self.dtype) * root
        B = torch.stack([self.pairs[k].lora_A.weight for k in idx]).to(self.dtype).mT * root
        return A, B

    def _set_stacked_factors(self, idx: list[int], A: Tensor, B: Tensor) -> None:
        """Write the stack's factors into its pairs' parameters: one batched scale, transpose and cast per factor, then
        one multi-tensor copy (on CUDA a few kernel launches for the whole stack instead of two per pair)."""
        inv_root = 1.0 / math.sqrt(self.pairs[idx[0]].scaling)
        dtype = self.pairs[idx[0]].lora_A.weight.dtype
        WB, WA = (A * inv_root).to(dtype), (B.mT * inv_root).to(dtype).contiguous()
        params = [p for k in idx for p in self.pairs[k].params]  # (lora_A, lora_B) per pair
        torch._foreach_copy_(params, [w for j in range(len(idx)) for w in (WA[j], WB[j])])

    def _ensure_frames(self) -> list[geometry.Frame]:
        """Per stack: the stacked factors and their QR frames, computed once per step and reused by every
        micro-batch."""
        if self._frames is None:
            self._factors = [self._stacked_factors(idx) for idx in self.stacks]
            self._frames = [geometry.frame(A, B, self.qr) for A, B in self._factors]
        return self._frames

    def _coordinates(self) -> _TangentCoordinates:
        return _TangentCoordinates(self._ensure_frames(), self._factors, self.dense_params, self.dtype)

    def _stack_grads(self, idx: list[int], per_pair) -> tuple[Tensor, Tensor]:
        """Parameter-space gradients of the stack's pairs stacked along a new leading dim, unscaled (see
        :meth:`_inv_root`): ``(G B, G^T A) * sqrt(s)``."""
        return tuple(torch.stack([per_pair[k][part] for k in idx]).to(self.dtype) for part in (0, 1))

    def _inv_root(self, idx: list[int]) -> float:
        """Parameter-space factor gradients times this are the intrinsic ``(gA, gB) = (G B, G^T A)``."""
        return 1.0 / math.sqrt(self.pairs[idx[0]].scaling)

    def _stacked_grads(self, grads: PerExampleGrads) -> list[tuple[Tensor, Tensor]]:
        """Per stack the rank-major per-example factor gradients (k, b, r, m) / (k, b, r, n), i.e. ``gA^T``, ``gB^T``
        (unscaled): the sampler's own stacks when it stacked the pairs as this optimizer does, else stacked here."""
        if grads.stacked is not None and grads.stacks == self.stacks:
            return [(gb.to(self.dtype), ga.to(self.dtype)) for gb, ga in grads.stacked]
        return [tuple(torch.stack([grads.lora[k][part].mT for k in idx]).to(self.dtype) for part in (0, 1))
                for idx in self.stacks]

    # ------------------------------------------------------------------ private accumulation

    @torch.no_grad()
    def accumulate(self, grads: PerExampleGrads) -> None:
        """Hand one micro-batch to the mechanism: the global intrinsic per-example norms and the factor gradients
        to clip and sum.

        Stacks of equal-shape modules are processed as one batch: (k, b, r, m) rank-major per-example factor
        gradients (written there by the gradient sampler), r x r Gram matrices for the norms and one reduction per
        stack.
        """
        if self.mechanism is None:
            raise RuntimeError("accumulate() is for the private optimizer; the non-private one reads p.grad in step()")
        if grads.batch_size == 0:
            return
        frames = self._ensure_frames()
        stacked = self._stacked_grads(grads)  # gA^T (k, b, r, m), gB^T (k, b, r, n), still to be scaled by inv_root
        sq = torch.zeros(grads.batch_size, dtype=self.dtype, device=frames[0].QA.device)
        per_example = []
        for idx, fr, (gA_t, gB_t) in zip(self.stacks, frames, stacked):
            inv_root = self._inv_root(idx)
            sq = sq + inv_root ** 2 * self._norm_sq(fr, gA_t, gB_t).sum(0)
            per_example += [PerExample(gA_t, dim=1, scale=inv_root, transpose=True),
                            PerExample(gB_t, dim=1, scale=inv_root, transpose=True)]
        dense = [g.to(self.dtype) for g in grads.dense]
        for g in dense:
            sq = sq + g.flatten(1).square().sum(1)
        per_example += [PerExample(g) for g in dense]
        self.mechanism.accumulate(sq, per_example, self._coordinates())

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            if self.mechanism is not None:
                self._private_step()
            else:
                self._nonprivate_step()
        finally:
            self._frames, self._factors = None, None
        return loss

    @property
    def last_stats(self) -> dict[str, float]:
        """Clipping statistics of the last private step (reading them synchronises with the device)."""
        return self.last_clip.as_dict() if self.last_clip is not None else {}

    def per_pair(self, stacked: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """``[A_0, B_0, A_1, B_1, ...]`` stacked per stack (release order) -> ``(A, B)`` per pair."""
        out: list = [None] * len(self.pairs)
        for i, idx in enumerate(self.stacks):
            for j, k in enumerate(idx):
                out[k] = (stacked[2 * i][j], stacked[2 * i + 1][j])
        return out

    @torch.no_grad()
    def private_release(self) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
        """The Gaussian mechanism's output for this logical batch (Eq. dp_tangent_noise), without the update.

        Per pair the lift ``(dA_dp, dB_dp)`` of ``(sum_i alpha_i P(G_i) + sigma C P(Xi)) / b`` and per dense
        parameter ``(sum_i alpha_i g_i + sigma C xi) / b``, with ``b`` the expected batch size.  Everything the
        optimizer does afterwards is post-processing of this release.  Consumes the accumulated sums and counts as
        a release for the budget.
        """
        if self.mechanism is None:
            raise RuntimeError("private_release() needs a mechanism")
        release = self.mechanism.release(self._coordinates())
        self.last_clip = release.clip
        n = 2 * len(self.stacks)
        return self.per_pair(release.values[:n]), release.values[n:]

    def _private_step(self) -> None:
        release = self.mechanism.release(self._coordinates())
        tau = self.mechanism.release_std  # per-dimension std of the released noise
        n = 2 * len(self.stacks)
        v = release.values
        precond = factorise.run_in_lockstep([self._update_stack(i, v[2 * i], v[2 * i + 1], tau)
                                             for i in range(len(self.stacks))])
        self._dense_step(release.values[n:])
        self.last_clip = release.clip
        if self._hooks:
            self._hooks(StepRecord(release, self.stacks, precond if self.adaptive else None, self._factors))

    def _nonprivate_step(self) -> None:
        frames = self._ensure_frames()
        grads, updates = [], []
        for pair in self.pairs:
            wa, wb = pair.params
            grads.append(None if wa.grad is None and wb.grad is None else (
                wb.grad if wb.grad is not None else torch.zeros_like(wb),
                (wa.grad if wa.grad is not None else torch.zeros_like(wa)).T))
        for i, (idx, fr) in enumerate(zip(self.stacks, frames)):
            if all(grads[k] is None for k in idx):
                continue
            filled = {k: grads[k] if grads[k] is not None else (torch.zeros_like(self.pairs[k].lora_B.weight),
                                                                  torch.zeros_like(self.pairs[k].lora_A.weight).T)
                      for k in idx}
            gA, gB = self._stack_grads(idx, filled)
            inv_root = self._inv_root(idx)
            dA, dB = geometry.lift_with_frame(fr, gA * inv_root, gB * inv_root)
            updates.append(self._update_stack(i, dA, dB, 0.0))
        factorise.run_in_lockstep(updates)
        self._dense_step([p.grad.to(self.dtype) if p.grad is not None else None for p in self.dense_params])
        if self._hooks:
            self._hooks(StepRecord(None, self.stacks))

    def _update_stack(self, i: int, dA: Tensor, dB: Tensor, tau: float) -> factorise.Update:
        """Adaptive direction from the (noisy) tangent update, then retraction and Procrustes alignment, for the
        stacked pairs of stack ``i``; returns the preconditioners ``(P_A, w_A, P_B, w_B)`` (None if not adaptive).
        A generator that yields its factorisations, so that the step makes each one once for all stacks
        (:func:`prismdp.optim.factorise.run_in_lockstep`)."""
        fr, (A, B) = self._frames[i], self._factors[i]
        group = self.param_groups[0]
        if self.options.lift_before("moments"):
            dA, dB = yield from _horizontal_lift(A, B, dA, dB, fr)
        precond = None
        if self.adaptive:
            st = self.state[self.pairs[self.stacks[i][0]].lora_A.weight]  # the stack's state lives on its first pair
            V, floor = moments(st, fr, dA, dB, tau, group["betas"], self.options)
            eig = yield "eigh", V
            dA, dB, precond = direction_from_eig(st, eig, floor, dA.dtype, group["eps"], group["betas"], self.options)
        if self.options.lift_before("retraction"):
            dA, dB = yield from _horizontal_lift(A, B, dA, dB, fr)
        core, bases = geometry.retraction_core(fr, dA, dB, group["lr"], self.qr)  # extends the step's frame
        A_new, B_new = geometry.retraction_factors(bases, (yield "svd", core))
        svd = yield "svd", geometry.procrustes_cross(A_new, B_new, A, B)
        self._set_stacked_factors(self.stacks[i], *geometry.procrustes_rotate(A_new, B_new, svd))
        return precond

    def _dense_step(self, grads: list[Tensor | None]) -> None:
        """Adam on the dense parameters (Euclidean geometry)."""
        if not self.dense_params:
            return
        group = self.param_groups[1]
        for p, g in zip(self.dense_params, grads):
            if g is not None:
                p.add_(adam_direction(self.state[p], g, group["betas"], group["eps"]).to(p.dtype), alpha=-group["lr"])
