"""LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

Adam moments with bias correction give a direction ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w`` per
parameter tensor; the step is rescaled by the layer-wise trust ratio ``||w|| / ||u||`` (1 when either norm is 0):
``w <- w - lr * (||w|| / ||u||) * u``.  Every parameter tensor is its own "layer" (for LoRA: each factor).
"""

from __future__ import annotations

import torch

from .adam import KeepStateDtypes, adam_direction, check_lr_betas, working_dtype

__all__ = ["Lamb"]


class Lamb(KeepStateDtypes, torch.optim.Optimizer):
    """LAMB; ``lr=5e-3`` is the paper's setting for every task family."""

    def __init__(self, params, lr: float = 5e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        check_lr_betas(lr, betas)
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
            for p in group["params"]:
                if p.grad is None:
                    continue
                w = p.to(working_dtype(p.dtype))
                u = adam_direction(self.state[p], p.grad.to(w.dtype), group["betas"], group["eps"])
                u = u + group["weight_decay"] * w
                p.sub_((group["lr"] * self.trust_ratio(w, u) * u).to(p.dtype))
        return loss
