"""Pieces the optimizers share: hyper-parameter checks, the working dtype and Adam's bias-corrected direction."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_lr_betas", "working_dtype", "adam_direction", "KeepStateDtypes"]


def check_lr_betas(lr: float, betas: tuple[float, float]) -> None:
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"betas must lie in [0, 1), got {betas}")


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32/bf16/fp16 parameters, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def adam_direction(state: dict, g: Tensor, betas: tuple[float, float], eps: float) -> Tensor:
    """Update Adam's moments in ``state`` (created on first use, in ``g``'s dtype) with the gradient ``g`` and
    return the bias-corrected direction ``m_hat / (sqrt(v_hat) + eps)``."""
    b1, b2 = betas
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(g)
        state["exp_avg_sq"] = torch.zeros_like(g)
    state["step"] += 1
    t = state["step"]
    state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
    state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
    return (state["exp_avg"] / (1 - b1**t)) / ((state["exp_avg_sq"] / (1 - b2**t)).sqrt() + eps)


class KeepStateDtypes:
    """Mixin for optimizers whose state is wider than their parameters (float32 moments of bf16 weights, PRISM's
    float64 r x r second moments): ``torch.optim.Optimizer.load_state_dict`` casts floating-point state to the
    parameter's dtype, which would make a resumed run drift from an uninterrupted one; this puts the saved dtypes
    back."""

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            live = self.state[params[index]]
            for key, value in saved.items():
                if torch.is_tensor(value) and value.is_floating_point() and live[key].dtype != value.dtype:
                    live[key] = value.to(device=live[key].device, copy=True)
