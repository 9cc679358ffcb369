"""LoRA-RITE (Yen et al., ICLR 2025, "LoRA Done RITE: Robust Invariant Transformation Equilibration for LoRA
Optimization"): adaptive rank-space preconditioning whose update of ``Z = s W_B W_A`` does not depend on the
factorisation (``(W_B, W_A) -> (W_B R, R^-1 W_A)`` for any invertible R gives the same trajectory of Z).

Per pair, with the factors ``X in {W_B (m, r), W_A^T (n, r)}`` and ``Y`` the other factor, every step:

1. ``Y = Q_Y R_Y`` (QR).  The *unmagnified* gradient ``gbar_X = g_X R_Y^-1`` is the gradient of X expressed in
   the orthonormal basis ``Q_Y`` of the other factor (e.g. ``gbar_{W_B} = s G Q_{W_A^T}``): it no longer depends
   on how the magnitude is split between the factors.  All gbar of all pairs are clipped to global norm
   ``clip_unmagnified_grad``.
2. The r x r second moment ``V_X`` lives in the basis ``Q_Y``; when the basis moves it is carried over by
   ``P_X = Q_Y,new^T Q_Y,old``: ``V_X <- b2 P V_X P^T + (1 - b2) gbar^T gbar / rows``.  The projection loses
   mass; the loss is measured by the eigenvalue distance ``d = max_i lambda_i(V) - lambda_i(P V P^T)`` and
   accumulated as ``rho_X <- b2 (rho_X + d)`` (the paper's "escaped mass").
3. Preconditioning, then momentum in the same moving basis: ``S = gbar (V + rho I)^-1/2``,
   ``M_X <- b1 M_X P^T + (1 - b1) S``; optionally the update is capped to RMS ``update_cap``
   (Adafactor-style update clipping; 0 disables it).
4. Back to the factor: ``X <- X - lr M_X R_Y^-T`` (both factors from the same old point), so the change of Z is
   ``-lr s (M_{W_B} Q_{W_A^T}^T + Q_{W_B} M_{W_A^T}^T)`` plus the second-order cross term, both gauge-free.

The decays use Adafactor's bias-corrected form ``b_t = b (1 - b^(t-1)) / (1 - b^t)``, which equals Adam's bias
correction.  ``R_Y^-1`` is a pseudo-inverse, so PEFT's ``lora_B = 0`` start is fine (``W_A`` waits one step).
Dense parameters (e.g. a classification head) get an AdamW step.  ``weight_decay`` (decoupled, on the factors)
breaks the invariance and is 0 by default.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from ..lora import LoraPair
from .adam import KeepStateDtypes, adam_direction, check_lr_betas, working_dtype

__all__ = ["LoraRITE"]


def _decay(beta: float, t: int) -> float:
    """Bias-corrected decay at 1-based step t (0 at t = 1)."""
    return beta * (1 - beta ** (t - 1)) / (1 - beta**t)


def _sym(x: Tensor) -> Tensor:
    return 0.5 * (x + x.mT)


class LoraRITE(KeepStateDtypes, torch.optim.Optimizer):
    """LoRA-RITE on PEFT pairs (``pair.lora_B.weight``, ``pair.lora_A.weight``), defaults as in the RITE paper."""

    def __init__(
        self,
        pairs: list[LoraPair],
        lr: float = 2e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        *,
        dense_params: Iterable[nn.Parameter] = (),
        clip_unmagnified_grad: float = 1.0,
        update_cap: float = 0.0,
        escape: bool = True,
        weight_decay: float = 0.0,
    ):
        check_lr_betas(lr, betas)
        if any(not pair.trains_A for pair in pairs):
            raise ValueError("LoRA-RITE trains both factors of every pair; got pairs with a frozen lora_A")
        dense_params = list(dense_params)
        groups = [{"params": [p for pair in pairs for p in pair.trained_params], "kind": "lora"}]
        if dense_params:
            groups.append({"params": dense_params, "kind": "dense"})
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.pairs = list(pairs)
        self.clip_unmagnified_grad = clip_unmagnified_grad
        self.update_cap = update_cap
        self.escape = escape

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _grad(p: Tensor, dtype: torch.dtype) -> Tensor:
        return torch.zeros_like(p, dtype=dtype) if p.grad is None else p.grad.to(dtype)

    def _inv_sqrt(self, V: Tensor, rho: Tensor, eps: float) -> Tensor:
        """``(V + rho I)^-1/2`` with ``eps`` added to the square roots of the eigenvalues."""
        w, Q = torch.linalg.eigh(_sym(V))
        d = 1.0 / ((w.clamp_min(0) + rho).sqrt() + eps)
        return (Q * d) @ Q.mT

    def _factor_step(self, st: dict, side: str, other: str, gbar: Tensor, Q_other: Tensor, t: int, group) -> Tensor:
        """Second moment, escaped mass, preconditioning and momentum of one factor; returns ``M`` (unmagnified)."""
        b1, b2 = group["betas"]
        rows, r = gbar.shape
        V_old = st.get(f"V_{side}", gbar.new_zeros(r, r))
        M_old = st.get(f"M_{side}", torch.zeros_like(gbar))
        rho_old = st.get(f"rho_{side}", gbar.new_zeros(()))
        P = Q_other.mT @ st[f"Q_{other}"] if f"Q_{other}" in st else torch.eye(r, dtype=gbar.dtype, device=gbar.device)
        V_rot = _sym(P @ V_old @ P.mT)
        escaped = gbar.new_zeros(())
        if self.escape:
            escaped = (torch.linalg.eigvalsh(V_old) - torch.linalg.eigvalsh(V_rot)).max().clamp_min(0)
        b1t, b2t = _decay(b1, t), _decay(b2, t)
        rho = b2t * (rho_old + escaped)
        V = b2t * V_rot + (1 - b2t) * (gbar.mT @ gbar) / rows
        S = gbar @ self._inv_sqrt(V, rho, group["eps"])
        M = b1t * (M_old @ P.mT) + (1 - b1t) * S
        st[f"V_{side}"], st[f"M_{side}"], st[f"rho_{side}"] = V, M, rho
        if self.update_cap > 0:
            rms = M.square().mean().sqrt()
            M = M / torch.clamp(rms / self.update_cap, min=1.0)
        return M

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        work = []  # per pair: factors, bases, inverse triangles, unmagnified grads
        for pair in self.pairs:
            WB, WA = pair.lora_B.weight, pair.lora_A.weight
            dt = working_dtype(WB.dtype)
            QB, RB = torch.linalg.qr(WB.to(dt))
            QA, RA = torch.linalg.qr(WA.T.to(dt))
            RBi, RAi = torch.linalg.pinv(RB), torch.linalg.pinv(RA)
            gB = self._grad(WB, dt) @ RAi  # gradient of W_B in the basis of W_A^T
            gA = self._grad(WA, dt).T @ RBi  # gradient of W_A^T in the basis of W_B
            work.append((pair, QB, QA, RBi, RAi, gB, gA))
        if self.clip_unmagnified_grad > 0 and work:
            norm = torch.stack([w[5].square().sum() + w[6].square().sum() for w in work]).sum().sqrt()
            scale = torch.clamp(self.clip_unmagnified_grad / (norm + 1e-30), max=1.0)
            work = [(*w[:5], w[5] * scale, w[6] * scale) for w in work]
        lr, wd = group["lr"], group["weight_decay"]
        for pair, QB, QA, RBi, RAi, gB, gA in work:
            st = self.state[pair.lora_B.weight]
            st["step"] = t = st.get("step", 0) + 1
            MB = self._factor_step(st, "B", "A", gB, QA, t, group)
            MA = self._factor_step(st, "A", "B", gA, QB, t, group)
            st["Q_A"], st["Q_B"] = QA, QB
            WB, WA = pair.lora_B.weight, pair.lora_A.weight
            dB = MB @ RAi.mT + wd * WB.to(MB.dtype)
            dA = (MA @ RBi.mT).T + wd * WA.to(MA.dtype)
            WB.sub_((lr * dB).to(WB.dtype))
            WA.sub_((lr * dA).to(WA.dtype))
        if len(self.param_groups) > 1:
            self._dense_adamw(self.param_groups[1])
        return loss

    def _dense_adamw(self, group) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            w = p.to(working_dtype(p.dtype))
            upd = adam_direction(self.state[p], p.grad.to(w.dtype), group["betas"], group["eps"])
            p.sub_((group["lr"] * (upd + group["weight_decay"] * w)).to(p.dtype))
