"""LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

Adam moments with bias correction give a direction ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w`` per
parameter tensor; the step is rescaled by the layer-wise trust ratio ``||w|| / ||u||`` (1 when either norm is 0):
``w <- w - lr * (||w|| / ||u||) * u``.  Every parameter tensor is its own "layer" (for LoRA: each factor).
"""

from __future__ import annotations

import torch

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """LAMB; ``lr=5e-3`` is the paper's setting for every task family."""

    def __init__(self, params, lr: float = 5e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if not (eps >= 0 and weight_decay >= 0):
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @staticmethod
    def trust_ratio(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``||w|| / ||u||``, or 1 when either norm is 0 (no host synchronisation)."""
        wn, un = w.norm(), u.norm()
        return torch.where((wn > 0) & (un > 0), wn / un.clamp_min(torch.finfo(u.dtype).tiny), torch.ones_like(wn))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    st["exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
                st["step"] += 1
                t = st["step"]
                g = p.grad.to(st["exp_avg"].dtype)
                st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = st["exp_avg"] / (1 - b1**t)
                v_hat = st["exp_avg_sq"] / (1 - b2**t)
                w = p.to(g.dtype)
                u = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * w
                p.sub_((group["lr"] * self.trust_ratio(w, u) * u).to(p.dtype))
        return loss
