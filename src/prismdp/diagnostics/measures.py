"""Pure measurement functions of the mechanism diagnostics: factors and noise in, numbers out.

Conventions are :mod:`prismdp.geometry`'s: ``Z = A B^T`` with ``A`` (m, r), ``B`` (n, r).  A *factor-space*
perturbation ``(xi_A, xi_B)`` of the factors moves ``Z`` by

    N_Z = xi_A B^T + A xi_B^T  +  eta xi_A xi_B^T          (paper eq. ``bilinear_noise_prob``, per unit step)
          \\_ first order _/      \\_ bilinear _/

and a tangent lift ``(dA, dB)`` (PRISM) by ``dA B^T + A dB^T``.  Closed forms (paper Prop. ``amp``,
Prop. ``scalar_range``, Thm. ``noise_energy``), for ``xi_A``, ``xi_B`` with i.i.d. N(0, tau^2) entries:

    E||xi_A B^T + A xi_B^T||^2 = tau^2 (m ||B||^2 + n ||A||^2)
    under (A, B) -> (cA, B/c):  tau^2 (m ||B||^2 / c^2 + n c^2 ||A||^2),  minimal at
    c* = (m ||B||^2 / (n ||A||^2))^(1/4) with value 2 tau^2 sqrt(mn) ||A|| ||B||
    E||eta xi_A xi_B^T||^2 = eta^2 m n r tau^4                  (gauge-free)
    E||tau P_Z(Xi)||^2 = tau^2 r (m + n - r)                     (PRISM, gauge-free)

Every norm is computed from r x r (or 2r x 2r) quantities, never from the dense m x n matrix, so the functions
work for any layer size.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .. import geometry

__all__ = [
    "lowrank_sq_norm",
    "first_order_sq",
    "bilinear_sq",
    "factor_noise_sq",
    "lift_sq",
    "delta_z_norm",
    "scalar_gauge",
    "gauge_statistic",
    "factor_energy",
    "bilinear_energy",
    "prism_energy",
    "c_star",
    "gram_stress",
    "adam_inverse_root",
    "SweepDraws",
    "gauge_sweep",
    "Band",
    "band",
    "range_index",
    "moving_average",
    "mean_se",
]


# ---------------------------------------------------------------- norms of low-rank products


def lowrank_sq_norm(U: Tensor, V: Tensor) -> Tensor:
    """``||U V^T||_F^2 = tr((U^T U)(V^T V))`` for ``U`` (.., m, k), ``V`` (.., n, k); reduces the last two dims."""
    return ((U.mT @ U) * (V.mT @ V)).sum((-2, -1))


def first_order_sq(A: Tensor, B: Tensor, xi_A: Tensor, xi_B: Tensor) -> Tensor:
    """``||xi_A B^T + A xi_B^T||_F^2`` (the first-order intrinsic noise of a factor-space perturbation)."""
    return lowrank_sq_norm(torch.cat([xi_A, A], -1), torch.cat([B, xi_B], -1))


def bilinear_sq(xi_A: Tensor, xi_B: Tensor, eta: float) -> Tensor:
    """``||eta xi_A xi_B^T||_F^2`` (the bilinear part; ``eta`` is the step size)."""
    return eta**2 * lowrank_sq_norm(xi_A, xi_B)


def factor_noise_sq(A: Tensor, B: Tensor, xi_A: Tensor, xi_B: Tensor, eta: float) -> Tensor:
    """``||xi_A B^T + A xi_B^T + eta xi_A xi_B^T||_F^2 = ||xi_A (B + eta xi_B)^T + A xi_B^T||_F^2``."""
    return lowrank_sq_norm(torch.cat([xi_A, A], -1), torch.cat([B + eta * xi_B, xi_B], -1))


def lift_sq(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tensor:
    """``||dA B^T + A dB^T||_F^2`` of a lift (a PRISM tangent vector, or first-order factor noise)."""
    return first_order_sq(A, B, dA, dB)


def delta_z_norm(A1: Tensor, B1: Tensor, A0: Tensor, B0: Tensor) -> float:
    """``||A1 B1^T - A0 B0^T||_F`` through thin QRs of ``[A1, -A0]`` and ``[B1, B0]`` (float64).

    The core ``R_u R_v^T`` is 2r x 2r; the cancellation between the two products happens there, with an
    absolute error ~ eps ||Z||, so small steps on large ``Z`` are still measured accurately.
    """
    _, Ru = torch.linalg.qr(torch.cat([A1, -A0], -1).double())
    _, Rv = torch.linalg.qr(torch.cat([B1, B0], -1).double())
    return float(torch.linalg.matrix_norm(Ru @ Rv.mT))


# ---------------------------------------------------------------- gauge and closed forms


def scalar_gauge(A: Tensor, B: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """The scalar gauge ``(A, B) -> (cA, B/c)``: same ``Z``, different factors."""
    return A * c, B / c


def gauge_statistic(A: Tensor, B: Tensor) -> float:
    """``m ||B||_F^2 + n ||A||_F^2``: ``E||first-order noise||^2 / tau^2`` (the paper's per-module ``S``)."""
    m, n = A.shape[-2], B.shape[-2]
    return float(m * B.double().square().sum() + n * A.double().square().sum())


def factor_energy(A: Tensor, B: Tensor, tau: float, c: float | np.ndarray = 1.0) -> float | np.ndarray:
    """``tau^2 (m ||B||^2 / c^2 + n c^2 ||A||^2)`` (paper eq. ``scalar_range_energy``)."""
    m, n = A.shape[-2], B.shape[-2]
    a2, b2 = float(A.double().square().sum()), float(B.double().square().sum())
    c = np.asarray(c, dtype=float)
    return tau**2 * (m * b2 / c**2 + n * c**2 * a2)


def bilinear_energy(m: int, n: int, r: int, tau: float, eta: float) -> float:
    """``eta^2 m n r tau^4`` (paper eq. ``naive_second`` with the step size)."""
    return eta**2 * m * n * r * tau**4


def prism_energy(m: int, n: int, r: int, tau: float) -> float:
    """``tau^2 r (m + n - r)``: PRISM's expected intrinsic noise energy (paper Thm. ``noise_energy``)."""
    return tau**2 * r * (m + n - r)


def c_star(A: Tensor, B: Tensor) -> float:
    """The gauge minimising the first-order factor-noise energy, ``(m ||B||^2 / (n ||A||^2))^(1/4)``."""
    m, n = A.shape[-2], B.shape[-2]
    return (m * float(B.double().square().sum()) / (n * float(A.double().square().sum()))) ** 0.25


def gram_stress(A: Tensor) -> float:
    """``||M^-1/2||_2 = 1 / sigma_min(A)`` for ``M = A^T A``; ``inf`` when ``A`` is rank deficient."""
    s = torch.linalg.svdvals(A.double())
    smin = float(s[-1])
    return 1.0 / smin if smin > 0 else math.inf


def adam_inverse_root(exp_avg_sq: Tensor, step: int, beta2: float, eps: float) -> Tensor:
    """Adam's diagonal ``P^-1/2``: ``1 / (sqrt(v / (1 - beta2^t)) + eps)``, elementwise (torch's Adam/AdamW)."""
    return 1.0 / ((exp_avg_sq / (1 - beta2**step)).sqrt() + eps)


# ---------------------------------------------------------------- the gauge sweep at fixed Z (paper App. C.2)


class SweepDraws(NamedTuple):
    """Squared intrinsic noise norms, each of shape (len(c), draws)."""

    c: np.ndarray
    first: np.ndarray  # ||xi_A B_c^T + A_c xi_B^T||^2
    bilinear: np.ndarray  # ||eta xi_A xi_B^T||^2
    total: np.ndarray  # ||first + bilinear||^2
    prism: np.ndarray  # ||tau P(Xi)||^2 sampled at (A_c, B_c)


def gauge_sweep(A: Tensor, B: Tensor, tau: float, eta: float, log10_c, draws: int,
                generator: torch.Generator | None = None) -> SweepDraws:
    """Monte-Carlo intrinsic noise along ``(A, B) -> (cA, B/c)`` at fixed ``Z = A B^T``.

    Per ``c``, ``draws`` independent factor-space draws ``xi_A``, ``xi_B`` (i.i.d. N(0, tau^2) entries) and
    ``draws`` independent PRISM draws ``tau (Xi_A, Xi_B)`` from :func:`prismdp.geometry.sample_tangent_noise` at
    the rescaled factors.  float64 throughout.
    """
    A, B = A.double(), B.double()
    c = np.power(10.0, np.asarray(log10_c, dtype=float))
    out = {k: np.empty((len(c), draws)) for k in ("first", "bilinear", "total", "prism")}
    for i, ci in enumerate(c):
        Ac, Bc = scalar_gauge(A, B, float(ci))
        xi_A = tau * torch.randn((draws, *A.shape), generator=generator, dtype=torch.float64)
        xi_B = tau * torch.randn((draws, *B.shape), generator=generator, dtype=torch.float64)
        Ab, Bb = Ac.expand(draws, *A.shape), Bc.expand(draws, *B.shape)
        out["first"][i] = first_order_sq(Ab, Bb, xi_A, xi_B).numpy()
        out["bilinear"][i] = bilinear_sq(xi_A, xi_B, eta).numpy()
        out["total"][i] = factor_noise_sq(Ab, Bb, xi_A, xi_B, eta).numpy()
        omega_A = torch.randn((draws, *A.shape), generator=generator, dtype=torch.float64)
        omega_B = torch.randn((draws, *B.shape), generator=generator, dtype=torch.float64)
        XA, XB = geometry.noise_with_frame(geometry.frame(Ac, Bc), omega_A, omega_B)
        out["prism"][i] = (tau**2 * lift_sq(Ab, Bb, XA, XB)).numpy()
    return SweepDraws(c, **out)


# ---------------------------------------------------------------- summaries


class Band(NamedTuple):
    """Spread of a quantity across runs (axis 0): mean line, inter-quartile band, min/max band."""

    mean: np.ndarray
    q25: np.ndarray
    q75: np.ndarray
    min: np.ndarray
    max: np.ndarray


def band(values) -> Band:
    """Spread over axis 0 of ``values`` (runs x steps)."""
    v = np.asarray(values, dtype=float)
    return Band(v.mean(0), np.quantile(v, 0.25, axis=0), np.quantile(v, 0.75, axis=0), v.min(0), v.max(0))


def range_index(values) -> np.ndarray:
    """``max - min`` over axis 0 (the paper's ``rho_t = max_c ||dZ_t|| - min_c ||dZ_t||``)."""
    v = np.asarray(values, dtype=float)
    return v.max(0) - v.min(0)


def moving_average(x, window: int) -> np.ndarray:
    """Trailing moving average; the first ``window - 1`` entries average what is available."""
    x = np.asarray(x, dtype=float)
    csum = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def mean_se(samples, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Sample mean and its standard error along ``axis``."""
    s = np.asarray(samples, dtype=float)
    k = s.shape[axis]
    return s.mean(axis), s.std(axis, ddof=1) / math.sqrt(k)
