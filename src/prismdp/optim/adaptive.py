"""PRISM's DP-aware rank-space adaptive step (Eqs. adam_moments, precond_dir, noise_floor), as pure tensor functions.

Per LoRA module (batched over a stack of equal-shape modules), from the released tangent lift ``(dA, dB)``:

    m_A <- b1 m_A + (1 - b1) dA                    V_A <- b2 V_A + (1 - b2) dA^T dA / m        (B: / n)
    U_A = m_hat_A (V_hat_A (+) lambda_A)^-1/2       with the floor lambda_A applied as ``floor_mode`` says

The paper's formula, the authors' optimizer defaults and the authors' training defaults (which produced the paper's
tables) are three different steps (``../shared/docs/prism-spec.md``, item 7); all three are options here:

``floor_mode``
    ``paper``     additive, ``V + lambda I`` with ``lambda_A = f tau^2 (m - r)/m tr(N^-1) / r``,
                  ``lambda_B = f tau^2 tr(M^-1) / r`` (Eq. noise_floor, the noise covariance's mean eigenvalue);
    ``geometry``  each eigenvalue clamped at ``lambda_A = f max(tau^2, tau^2 (m - r)/m tr(N^-1) / r)``,
                  ``lambda_B = f max(tau^2, tau^2 tr(M^-1) / r)`` (the reference optimizer's default);
    ``scalar``    clamped at ``f tau^2`` (the reference training script, f = 0.5);
    ``none``      no floor (only ``eps`` and the condition clamp).
    ``tau = sigma C / b`` is the per-coordinate std of the release; without noise (``tau = 0``) no floor applies.
``debias``
    subtract the known noise covariance ``tau^2 (m - r)/m N^-1`` (A) and ``tau^2 M^-1`` (B) from ``V_hat``
    (Appendix A.26) before the floor.
``horizontal_lift``
    ``none`` | ``moments`` (make the release's lift horizontal, ``A^T dA = dB^T B``, before the moments) |
    ``retraction`` (make the direction horizontal before the retraction) | ``both``: the same dZ, other factors.
``cond_max``
    condition-number clamp: eigenvalues below ``max / cond_max`` are raised to it (``inf`` disables it).

Presets: ``paper`` (the library's formula: paper floors, debiasing on, no lift, cond 1e4) and ``reference`` (the
authors' training defaults: scalar floor 0.5 tau^2, debiasing off, horizontal lift both, cond 1e4).  Every variant is
equivariant under orthogonal gauges ``(A, B) -> (A Q, B Q)``, the only gauge PRISM's balanced factors leave, and by
the paper's Theorem precond_bound amplifies any perturbation's energy by at most ``1 / lambda_min``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import geometry

__all__ = ["AdaptiveOptions", "PRESETS", "FLOOR_MODES", "LIFTS", "precondition", "precondition_from_eig", "symmetric",
           "noise_covariances", "floors", "adaptive_direction", "moments", "direction_from_eig"]

FLOOR_MODES = ("paper", "geometry", "scalar", "none")
LIFTS = ("none", "moments", "retraction", "both")


@dataclass(frozen=True)
class AdaptiveOptions:
    floor_mode: str = "paper"
    floor_factor: float = 1.0
    debias: bool = True
    horizontal_lift: str = "none"
    cond_max: float = 1e4

    def __post_init__(self):
        if self.floor_mode not in FLOOR_MODES:
            raise ValueError(f"floor_mode must be one of {', '.join(FLOOR_MODES)}, got {self.floor_mode!r}")
        if self.horizontal_lift not in LIFTS:
            raise ValueError(f"horizontal_lift must be one of {', '.join(LIFTS)}, got {self.horizontal_lift!r}")
        if not (isinstance(self.floor_factor, (int, float)) and self.floor_factor >= 0):
            raise ValueError(f"floor_factor must be a number >= 0, got {self.floor_factor!r}")
        if not (isinstance(self.cond_max, (int, float)) and self.cond_max >= 1):
            raise ValueError(f"cond_max must be a number >= 1 (inf disables the clamp), got {self.cond_max!r}")
        if not isinstance(self.debias, bool):
            raise ValueError(f"debias must be true or false, got {self.debias!r}")

    def lift_before(self, where: str) -> bool:
        """Whether the lift is made horizontal before ``where`` ('moments' or 'retraction')."""
        return self.horizontal_lift in (where, "both")

    @classmethod
    def from_preset(cls, preset: str = "paper", **overrides) -> "AdaptiveOptions":
        if preset not in PRESETS:
            raise ValueError(f"unknown PRISM preset {preset!r}; choose one of {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


PRESETS = {
    "paper": AdaptiveOptions(),
    "reference": AdaptiveOptions(floor_mode="scalar", floor_factor=0.5, debias=False, horizontal_lift="both",
                                 cond_max=1e4),
}


def precondition(V: Tensor, floor: Tensor | float, eps: float, cond_max: float, clamp: bool = False
                 ) -> tuple[Tensor, Tensor]:
    """``(V (+) floor)^-1/2`` for symmetric (.., r, r) ``V``: eigenvalues clipped at 0, then ``+ floor + eps``
    (``clamp=False``, the additive floor) or ``max(w + eps, floor)`` (``clamp=True``), then raised to at least
    ``max / cond_max``.  Returns the matrix and the final eigenvalues (for diagnostics)."""
    return precondition_from_eig(torch.linalg.eigh(symmetric(V)), floor, eps, cond_max, clamp)


def symmetric(V: Tensor) -> Tensor:
    """The symmetric part of ``V``, the matrix :func:`precondition` eigendecomposes."""
    return 0.5 * (V + V.mT)


def precondition_from_eig(eig: tuple[Tensor, Tensor], floor: Tensor | float, eps: float, cond_max: float,
                          clamp: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`precondition` from the eigendecomposition ``(w, Q)`` of ``symmetric(V)``."""
    w, Q = eig
    if clamp:
        # a float floor stays a scalar operand (a tensor made from it would be a host-to-device copy per call)
        w = (w.clamp_min(0.0) + eps).clamp_min(floor)
    else:
        w = w.clamp_min(0.0) + floor + eps
    if math.isfinite(cond_max):
        w = torch.maximum(w, w.amax(-1, keepdim=True) / cond_max)
    return (Q * w.rsqrt().unsqueeze(-2)) @ Q.mT, w


def noise_covariances(fr: geometry.Frame, m: int, tau: float) -> tuple[Tensor, Tensor]:
    """The second moments the release's noise adds to ``V_A``, ``V_B`` (float64, (.., r, r)):
    ``E[Xi_A^T Xi_A / m] tau^2 = tau^2 (m - r)/m N^-1`` and ``E[Xi_B^T Xi_B / n] tau^2 = tau^2 M^-1``."""
    r = fr.RA.shape[-1]
    eye = torch.eye(r, dtype=torch.float64, device=fr.RA.device)
    inv_RA = torch.linalg.solve_triangular(fr.RA.double(), eye, upper=True)
    inv_RB = torch.linalg.solve_triangular(fr.RB.double(), eye, upper=True)
    M_inv, N_inv = inv_RA @ inv_RA.mT, inv_RB @ inv_RB.mT
    return tau**2 * (m - r) / m * N_inv, tau**2 * M_inv


def floors(options: AdaptiveOptions, noise_A: Tensor, noise_B: Tensor, tau: float) -> tuple[Tensor | float, Tensor | float]:
    """The floors ``(lambda_A, lambda_B)`` (shape (.., 1), or 0.0) of ``options.floor_mode``."""
    if options.floor_mode == "none" or tau == 0:
        return 0.0, 0.0
    f, r = options.floor_factor, noise_A.shape[-1]
    mean_A = noise_A.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / r
    mean_B = noise_B.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True) / r
    if options.floor_mode == "paper":
        return f * mean_A, f * mean_B
    if options.floor_mode == "geometry":
        return f * mean_A.clamp_min(tau**2), f * mean_B.clamp_min(tau**2)
    return f * tau**2, f * tau**2  # scalar


def adaptive_direction(state: dict, fr: geometry.Frame, dA: Tensor, dB: Tensor, tau: float,
                       betas: tuple[float, float], eps: float, options: AdaptiveOptions
                       ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """One rank-space Adam step for a stack of modules: updates ``state`` (created on first use: ``step``, first
    moments ``mA``, ``mB`` like ``dA``, ``dB``; float64 second moments ``VA``, ``VB`` (.., r, r)) and returns the
    directions ``(U_A, U_B)`` and the preconditioners ``(P_A, w_A, P_B, w_B)``.  ``dA`` (.., m, r), ``dB`` (.., n, r)
    is the released lift, ``tau`` its noise level (0 without noise).

    In two parts around its one eigendecomposition (of both sides at once), for callers that batch it across stacks
    (:mod:`prismdp.optim.factorise`): :func:`moments` and :func:`direction_from_eig`."""
    V, floor = moments(state, fr, dA, dB, tau, betas, options)
    eig = torch.linalg.eigh(V)
    return direction_from_eig(state, eig, floor, dA.dtype, eps, betas, options)


def moments(state: dict, fr: geometry.Frame, dA: Tensor, dB: Tensor, tau: float, betas: tuple[float, float],
            options: AdaptiveOptions) -> tuple[Tensor, Tensor | float]:
    """:func:`adaptive_direction` up to its eigendecomposition: updates ``state``'s moments and returns the
    symmetric (2, .., r, r) matrix ``stack([V_A, V_B])`` (bias-corrected, debiased as ``options`` say) to be
    eigendecomposed, and the floor."""
    beta1, beta2 = betas
    m, r = dA.shape[-2], dA.shape[-1]
    n = dB.shape[-2]
    if not state:
        state["step"] = 0
        state["mA"], state["mB"] = torch.zeros_like(dA), torch.zeros_like(dB)
        state["VA"] = torch.zeros(*dA.shape[:-2], r, r, dtype=torch.float64, device=dA.device)
        state["VB"] = torch.zeros(*dB.shape[:-2], r, r, dtype=torch.float64, device=dA.device)
    state["step"] += 1
    t = state["step"]
    state["mA"].mul_(beta1).add_(dA, alpha=1 - beta1)
    state["mB"].mul_(beta1).add_(dB, alpha=1 - beta1)
    dA64, dB64 = dA.double(), dB.double()
    state["VA"].mul_(beta2).add_(dA64.mT @ dA64 / m, alpha=1 - beta2)
    state["VB"].mul_(beta2).add_(dB64.mT @ dB64 / n, alpha=1 - beta2)
    VA = state["VA"] / (1 - beta2**t)
    VB = state["VB"] / (1 - beta2**t)
    floor_A = floor_B = 0.0
    if tau > 0:
        noise_A, noise_B = noise_covariances(fr, m, tau)
        if options.debias:
            VA, VB = VA - noise_A, VB - noise_B
        floor_A, floor_B = floors(options, noise_A, noise_B, tau)
    # both sides in one eigendecomposition (on CUDA each call is a cuSOLVER launch and a host read of its status)
    if torch.is_tensor(floor_A) or floor_A != floor_B:
        floor = torch.stack([torch.as_tensor(f, dtype=torch.float64, device=VA.device).expand(*VA.shape[:-2], 1)
                             for f in (floor_A, floor_B)])
    else:  # one float floor for both
        floor = floor_A
    return symmetric(torch.stack([VA, VB])), floor


def direction_from_eig(state: dict, eig: tuple[Tensor, Tensor], floor: Tensor | float, dtype: torch.dtype,
                       eps: float, betas: tuple[float, float], options: AdaptiveOptions
                       ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """:func:`adaptive_direction` from the eigendecomposition of :func:`moments`' matrix."""
    clamp = options.floor_mode in ("geometry", "scalar")
    P, w = precondition_from_eig(eig, floor, eps, options.cond_max, clamp)
    (PA, PB), (wA, wB) = P.unbind(0), w.unbind(0)
    bc1 = 1 - betas[0] ** state["step"]
    return (state["mA"] / bc1) @ PA.to(dtype), (state["mB"] / bc1) @ PB.to(dtype), (PA, wA, PB, wB)
