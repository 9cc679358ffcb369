"""Pure tensor math on the manifold of rank-r matrices (tensors in, tensors out).

Conventions (the paper's): a point is ``Z = A @ B.T`` with ``A`` of shape (m, r) and ``B`` of shape (n, r);
``M = A.T A`` and ``N = B.T B``; a tangent vector at Z is represented by a *lift* ``(dA, dB)`` with
``dZ = dA @ B.T + A @ dB.T``.  Per-example arguments may carry leading batch dimensions; the factors
broadcast against them.

Everything here is written with orthonormal bases (QR) instead of Gram inverses: with ``A = Q_A R_A`` and
``B = Q_B R_B``, ``M^-1 = R_A^-1 R_A^-T``, ``Pi_A = Q_A Q_A^T`` and every inverse is a triangular solve.
That keeps the formulas accurate for ill-conditioned factors (the released intrinsic quantities do not
depend on the factor conditioning) and costs O((m + n) r^2) per module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "QR_METHODS",
    "default_qr",
    "thin_qr",
    "cholesky_qr",
    "Frame",
    "frame",
    "tangent_project",
    "canonical_lift",
    "lift_with_frame",
    "horizontal_lift",
    "tangent_norm_sq",
    "projected_grad_norm_sq",
    "projected_grad_norm_sq_balanced",
    "per_example_norm_sq_balanced",
    "sample_tangent_noise",
    "noise_with_frame",
    "retract",
    "procrustes_align",
    "balance",
    "tangent_to_dense",
]


class Frame(NamedTuple):
    """Thin QR factors of the two LoRA factors: ``A = QA @ RA``, ``B = QB @ RB``."""

    QA: Tensor  # (.., m, r)
    RA: Tensor  # (.., r, r) upper triangular
    QB: Tensor  # (.., n, r)
    RB: Tensor  # (.., r, r) upper triangular


#: the thin QR factorisations behind :func:`frame` and :func:`retract` (``None`` there: :func:`default_qr`)
QR_METHODS = ("householder", "cholesky")


def default_qr(device: torch.device, dtype: torch.dtype) -> str:
    """``"cholesky"`` (:func:`cholesky_qr`) for float32 / bfloat16 / float16 matrices on CUDA, ``"householder"``
    (``torch.linalg.qr``) otherwise: on the CPU, and in float64, whose Householder Q is orthonormal to ~1e-15 where
    CholeskyQR's shift leaves ~1e-9.

    On a GPU ``torch.linalg.qr`` of a (k, m, r) batch runs cuSOLVER's unblocked kernels once per matrix, where
    CholeskyQR is a few batched products, r x r factorisations and triangular solves; on the CPU LAPACK's Householder
    QR is faster (measured: docs/gpu.md, ``bench.studies.gpu_qr``).
    """
    return "cholesky" if device.type == "cuda" and dtype != torch.float64 else "householder"


def thin_qr(X: Tensor, method: str | None = None) -> tuple[Tensor, Tensor]:
    """Thin QR ``X = Q R`` of (.., m, r), ``Q`` with orthonormal columns and ``R`` upper triangular, by ``method``
    (one of :data:`QR_METHODS`; ``None``: :func:`default_qr`)."""
    method = method or default_qr(X.device, X.dtype)
    if method == "householder":
        return torch.linalg.qr(X)
    if method == "cholesky":
        return cholesky_qr(X)
    raise ValueError(f"unknown thin QR method {method!r}; choose one of {QR_METHODS} (or None: by device)")


def cholesky_qr(X: Tensor) -> tuple[Tensor, Tensor]:
    """Thin QR of X (.., m, r) by shifted CholeskyQR2 in float64, without a host synchronisation.

    Two passes of ``R_k = chol(Y^T Y + s_k I)^T``, ``Y <- Y R_k^-1``; ``Q = Y``, ``R = R_2 R_1`` (so ``Q R = X`` to
    rounding whatever the shifts).  The shift ``s = 11 (m r + r (r + 1)) u ||Y||_F^2`` (u the float64 unit roundoff)
    bounds the rounding error of the Gram matrix, so each factorisation succeeds for any X, rank-deficient or zero
    included (Fukaya, Kannan, Nakatsukasa, Yamamoto and Yanagisawa, "Shifted Cholesky QR for computing the QR
    factorization of ill-conditioned matrices", SIAM J. Sci. Comput. 42(1), 2020); ``cholesky_ex`` leaves the
    status unread, so nothing waits for the device.  Q is orthonormal to ~ ``11 (m r + r^2) r u`` (3e-9 for
    m = 8192, r = 16) for cond(X) up to ~1e8; columns of X beyond that (a rank-deficient block) come out as columns of
    Q that are not unit but carry only ~ sqrt(s) of weight in R.  Returned in X's dtype.
    """
    m, r = X.shape[-2:]
    Y = X.to(torch.float64)
    eye = torch.eye(r, dtype=torch.float64, device=X.device)
    c = 11.0 * (m * r + r * (r + 1)) * torch.finfo(torch.float64).eps / 2
    R = None
    for _ in range(2):
        G = Y.mT @ Y
        shift = c * G.diagonal(dim1=-2, dim2=-1).sum(-1) + torch.finfo(torch.float64).tiny
        L = torch.linalg.cholesky_ex(G + shift[..., None, None] * eye).L
        Y = torch.linalg.solve_triangular(L.mT, Y, upper=True, left=False)
        R = L.mT if R is None else L.mT @ R
    return Y.to(X.dtype), R.to(X.dtype)


def frame(A: Tensor, B: Tensor, qr: str | None = None) -> Frame:
    """Orthonormal bases of col(A) and col(B) with their triangular factors (thin QR by ``qr``: :func:`thin_qr`)."""
    QA, RA = thin_qr(A, qr)
    QB, RB = thin_qr(B, qr)
    return Frame(QA, RA, QB, RB)


def _right_solve(X: Tensor, R: Tensor) -> Tensor:
    """X @ R^-1 for upper-triangular R."""
    return torch.linalg.solve_triangular(R, X, upper=True, left=False)


def _right_solve_t(X: Tensor, R: Tensor) -> Tensor:
    """X @ R^-T for upper-triangular R."""
    return torch.linalg.solve_triangular(R.mT, X, upper=False, left=False)


def _proj(Q: Tensor, X: Tensor) -> Tensor:
    """Q Q^T X."""
    return Q @ (Q.mT @ X)


def tangent_project(A: Tensor, B: Tensor, G: Tensor) -> Tensor:
    """Dense orthogonal projection onto the tangent space at Z = A B^T (eq. ``tangent_proj``).

    ``P(G) = Pi_A G + G Pi_B - Pi_A G Pi_B``. Forms m x n matrices: a reference for small sizes.
    """
    QA, _ = torch.linalg.qr(A)
    QB, _ = torch.linalg.qr(B)
    PA_G = QA @ (QA.mT @ G)
    return PA_G + (G - PA_G) @ QB @ QB.mT


def lift_with_frame(fr: Frame, gA: Tensor, gB: Tensor) -> tuple[Tensor, Tensor]:
    """Canonical lift (eq. ``canonical``) given a precomputed :class:`Frame`."""
    YA = _right_solve_t(_right_solve(gA, fr.RB), fr.RB)  # gA N^-1
    YB = _right_solve_t(_right_solve(gB, fr.RA), fr.RA)  # gB M^-1
    return YA - 0.5 * _proj(fr.QA, YA), YB - 0.5 * _proj(fr.QB, YB)


def canonical_lift(A: Tensor, B: Tensor, gA: Tensor, gB: Tensor) -> tuple[Tensor, Tensor]:
    """Canonical lift of the projected gradient (eq. ``canonical``).

    From factor gradients ``gA = G B`` (.., m, r) and ``gB = G^T A`` (.., n, r) returns ``(dA, dB)`` with
    ``dA B^T + A dB^T = P_{A,B}(G)``:
    ``dA = gA N^-1 - 1/2 Pi_A gA N^-1``, ``dB = gB M^-1 - 1/2 Pi_B gB M^-1``.
    """
    return lift_with_frame(frame(A, B), gA, gB)


def horizontal_lift(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, fr: Frame | None = None) -> tuple[Tensor, Tensor]:
    """The horizontal (minimum-norm) lift of the tangent vector ``dA B^T + A dB^T`` (Prop. ``prop:min_norm_lift``).

    Returns ``(dA + A W, dB - B W^T)``, the same ``dZ``, with the r x r ``W`` solving the Sylvester equation
    ``M W + W N = dB^T B - A^T dA`` (``M = A^T A``, ``N = B^T B``), so that ``A^T dA' = dB'^T B``: the lift has no
    component along the gauge orbit.  ``M`` and ``N`` come from the frame's triangular factors
    (``M = R_A^T R_A``); the equation is solved in float64 through the eigendecompositions of ``M`` and ``N``
    (both positive definite on the manifold).  O((m + n) r^2); batched over leading dimensions.
    """
    fr = frame(A, B) if fr is None else fr
    MN, rhs = horizontal_lift_system(A, B, dA, dB, fr)
    return horizontal_lift_solve(A, B, dA, dB, torch.linalg.eigh(MN), rhs)


def horizontal_lift_system(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, fr: Frame) -> tuple[Tensor, Tensor]:
    """:func:`horizontal_lift`'s Sylvester equation: ``(stack([M, N]), rhs)`` in float64, ``M``, ``N`` (2, .., r, r)
    to be eigendecomposed, and the right-hand side ``dB^T B - A^T dA``."""
    RA, RB = fr.RA.double(), fr.RB.double()
    rhs = (dB.mT.double() @ B.double()) - (A.mT.double() @ dA.double())
    return torch.stack([RA.mT @ RA, RB.mT @ RB]), rhs


def horizontal_lift_solve(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, eig: tuple[Tensor, Tensor], rhs: Tensor
                          ) -> tuple[Tensor, Tensor]:
    """:func:`horizontal_lift` from the eigendecomposition ``eig = (w, Q)`` of :func:`horizontal_lift_system`'s
    ``stack([M, N])``."""
    (wm, wn), (Um, Vn) = eig[0].unbind(0), eig[1].unbind(0)
    W = Um @ ((Um.mT @ rhs @ Vn) / (wm.unsqueeze(-1) + wn.unsqueeze(-2))) @ Vn.mT
    W = W.to(dA.dtype)
    return dA + A @ W, dB - B @ W.mT


def tangent_norm_sq(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tensor:
    """``||dA B^T + A dB^T||_F^2`` without forming it (eq. ``tangent_norm``); reduces the last two dims.

    ``tr(dA^T dA N) + tr(dB^T dB M) + 2 tr((A^T dA)(B^T dB))``, evaluated in the QR frame: with
    ``X = dA R_B^T`` and ``Y = dB R_A^T`` (so ``dZ = X Q_B^T + Q_A Y^T``) it is
    ``||X||^2 + ||Y||^2 + 2 tr((Q_A^T X)^T (Q_B^T Y)^T)``.  Forming M and N instead loses cond(A)^2 * eps.
    """
    QA, RA = torch.linalg.qr(A)
    QB, RB = torch.linalg.qr(B)
    X = dA @ RB.mT  # dA B^T = X Q_B^T
    Y = dB @ RA.mT  # A dB^T = Q_A Y^T
    t3 = ((QA.mT @ X) * (QB.mT @ Y).mT).sum((-2, -1))
    return X.square().sum((-2, -1)) + Y.square().sum((-2, -1)) + 2.0 * t3


def projected_grad_norm_sq(fr: Frame, gA: Tensor, gB: Tensor) -> Tensor:
    """``||P(G)||_F^2`` straight from the factor gradients ``gA = G B``, ``gB = G^T A``, for any factors.

    ``||P(G)||^2 = ||G Q_B||^2 + ||G^T Q_A||^2 - ||Q_A^T G Q_B||^2`` with ``G Q_B = gA R_B^-1`` and
    ``G^T Q_A = gB R_A^-1``: r x r work per example, no lift needed (the lift is linear, so only the norms
    need per-example work).  Accurate to ~ cond(factors) * eps.  For balanced factors (what PRISM keeps) use the
    cheaper :func:`projected_grad_norm_sq_balanced`.
    """
    X = _right_solve(gA, fr.RB)  # G Q_B        (.., m, r)
    Y = _right_solve(gB, fr.RA)  # G^T Q_A      (.., n, r)
    core = fr.QA.mT @ X  # Q_A^T G Q_B  (.., r, r)
    sq = X.square().sum((-2, -1)) + Y.square().sum((-2, -1)) - core.square().sum((-2, -1))
    return sq.clamp_min(0.0)


def projected_grad_norm_sq_balanced(fr: Frame, gA: Tensor, gB: Tensor) -> Tensor:
    """:func:`projected_grad_norm_sq` through r x r Gram matrices, for *balanced* factors (``A^T A = B^T B``).

    ``||G Q_B||^2 - ||Q_A^T G Q_B||^2 = <gA^T gA - (Q_A^T gA)^T (Q_A^T gA), N^-1>`` and
    ``||G^T Q_A||^2 = <gB^T gB, M^-1>`` with ``N^-1 = R_B^-1 R_B^-T``, ``M^-1 = R_A^-1 R_A^-T``: ``gA`` and ``gB``
    are read by three batched matmuls and never copied or solved against (the per-example cost of PRISM's
    clipping).  At a balanced point ``M = N`` is diagonal, so the weights ``N^-1`` carry no cancellation and the
    result is accurate to ~ eps whatever the conditioning of Z; for unbalanced factors the error grows like
    cond(N) * eps.  The frame's batch shape must broadcast against the leading dimensions of ``gA`` / ``gB``
    (e.g. (k, 1, m, r) against (k, b, m, r)).
    """
    eye = torch.eye(fr.RA.shape[-1], dtype=fr.RA.dtype, device=fr.RA.device)
    inv_RA = torch.linalg.solve_triangular(fr.RA, eye, upper=True)
    inv_RB = torch.linalg.solve_triangular(fr.RB, eye, upper=True)
    M_inv, N_inv = inv_RA @ inv_RA.mT, inv_RB @ inv_RB.mT
    C = fr.QA.mT @ gA  # Q_A^T G B              (.., r, r)
    resid_A = gA.mT @ gA - C.mT @ C  # gA^T (I - Pi_A) gA    (.., r, r)
    sq = (resid_A * N_inv).sum((-2, -1)) + ((gB.mT @ gB) * M_inv).sum((-2, -1))
    return sq.clamp_min(0.0)


def per_example_norm_sq_balanced(fr: Frame, gA_t: Tensor, gB_t: Tensor) -> Tensor:
    """:func:`projected_grad_norm_sq_balanced` of a stack of k modules' per-example gradients, given rank-major:
    ``gA_t`` (k, b, r, m) holds ``gA^T`` and ``gB_t`` (k, b, r, n) ``gB^T`` per module and example, the frame has batch
    shape (k,).  Returns (k, b).  Each gradient is read as it lies: ``Q_A^T gA`` for all b examples is one
    (k, b r, m) @ (k, m, r) product (broadcasting the frame over the examples copied it b times), and the Gram
    matrices are ``gA_t gA_t^T``.  For balanced factors, like :func:`projected_grad_norm_sq_balanced`."""
    k, b, r, m = gA_t.shape
    eye = torch.eye(r, dtype=fr.RA.dtype, device=fr.RA.device)
    inv_RA = torch.linalg.solve_triangular(fr.RA, eye, upper=True)
    inv_RB = torch.linalg.solve_triangular(fr.RB, eye, upper=True)
    M_inv, N_inv = (inv_RA @ inv_RA.mT).unsqueeze(1), (inv_RB @ inv_RB.mT).unsqueeze(1)  # (k, 1, r, r)
    Ct = (gA_t.reshape(k, b * r, m) @ fr.QA).view(k, b, r, r)  # (Q_A^T gA)^T
    resid_A = gA_t @ gA_t.mT - Ct @ Ct.mT  # gA^T (I - Pi_A) gA
    sq = (resid_A * N_inv).sum((-2, -1)) + ((gB_t @ gB_t.mT) * M_inv).sum((-2, -1))
    return sq.clamp_min(0.0)


def noise_with_frame(fr: Frame, omega_A: Tensor, omega_B: Tensor) -> tuple[Tensor, Tensor]:
    """Tangent noise lift from standard normal draws ``omega_A`` (m, r) and ``omega_B`` (n, r).

    Returns ``Xi_A = (I - Pi_A) Omega_A R_B^-T`` and ``Xi_B = Omega_B R_A^-T``.  Since
    ``R_B^-T = O N^-1/2`` for an orthogonal ``O`` (polar decomposition) and ``Omega O`` has the law of
    ``Omega``, the pair has exactly the law of eq. ``noise_form`` (``(I - Pi_A) Omega_A N^-1/2``,
    ``Omega_B M^-1/2``) while needing only triangular solves.  Its intrinsic value is
    ``(I - Pi_A) Omega_A Q_B^T + Q_A Omega_B^T``, a draw of ``P(Xi)`` for dense standard normal ``Xi``.
    """
    perp = omega_A - _proj(fr.QA, omega_A)
    return _right_solve_t(perp, fr.RB), _right_solve_t(omega_B, fr.RA)


def sample_tangent_noise(
    A: Tensor, B: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Isotropic Gaussian on the tangent space at Z = A B^T, as a lift ``(Xi_A, Xi_B)`` (eq. ``noise_form``).

    Uses O((m + n) r) random numbers; ``Xi_A B^T + A Xi_B^T`` has the law of ``P_{A,B}(Xi)`` for an
    m x n standard normal ``Xi`` and expected squared norm ``r (m + n - r)``.
    """
    omega_A = torch.randn(A.shape, generator=generator, dtype=A.dtype, device=A.device)
    omega_B = torch.randn(B.shape, generator=generator, dtype=B.dtype, device=B.device)
    return noise_with_frame(frame(A, B), omega_A, omega_B)


def _extend_basis(Q: Tensor, R: Tensor, D: Tensor, qr: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``[Q R, D] = [Q, Q2] [[R, C], [0, R2]]``: an orthonormal basis of ``col([Q R, D])`` from the known thin QR of
    the first block, orthogonalising only ``D`` (two Gram-Schmidt passes against ``Q``, "twice is enough", then a thin
    QR of what is left, by ``qr``).  Returns ``(Q2, C, R2)``; if ``D`` has no component outside ``col(Q)``, ``R2`` is
    (near) zero and ``Q2``'s columns carry no weight."""
    C = Q.mT @ D
    X = D - Q @ C
    C2 = Q.mT @ X
    X = X - Q @ C2
    Q2, R2 = thin_qr(X, qr)
    return Q2, C + C2, R2


def retract(
    A: Tensor, B: Tensor, dA: Tensor, dB: Tensor, lr: float | Tensor, fr: Frame | None = None, qr: str | None = None
) -> tuple[Tensor, Tensor]:
    """Best rank-r approximation of ``A B^T - lr (dA B^T + A dB^T)`` as balanced factors (eq. ``retraction``).

    The matrix equals ``[A, dA] K [B, dB]^T`` with ``K = [[I, -lr I], [-lr I, 0]]``: orthonormal bases of the two
    (m, 2r) / (n, 2r) stacks, SVD of the 2r x 2r core, keep the top r.  The bases extend the frame of ``(A, B)`` (given
    as ``fr``, or computed): only the new directions ``dA``, ``dB`` are orthogonalised, which at (30, 1536, 16) costs
    ~half of a QR of the whole stack.  O((m + n) r^2).  The returned factors satisfy
    ``A_new^T A_new = B_new^T B_new = diag(s)``.  Batched over leading dimensions.  ``qr``: the thin QR of the new
    directions (and of the frame if not given), :func:`thin_qr`.
    """
    fr = frame(A, B, qr) if fr is None else fr
    core, bases = retraction_core(fr, dA, dB, lr, qr)
    return retraction_factors(bases, torch.linalg.svd(core))


def retraction_core(fr: Frame, dA: Tensor, dB: Tensor, lr: float | Tensor, qr: str | None = None
                    ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """:func:`retract` up to its SVD: the (.., 2r, 2r) core and the bases ``(QA, QA2, QB, QB2)`` that
    :func:`retraction_factors` needs."""
    QA2, CA, RA2 = _extend_basis(fr.QA, fr.RA, dA, qr)
    QB2, CB, RB2 = _extend_basis(fr.QB, fr.RB, dB, qr)
    # a Python number stays one (a scalar operand: no tensor made and copied to the device per call)
    lr_t = lr if isinstance(lr, (int, float)) else torch.as_tensor(lr, dtype=dA.dtype, device=dA.device)
    # core = Ru K Rv^T with Ru = [[RA, CA], [0, RA2]], Rv = [[RB, CB], [0, RB2]] and K = [[I, -lr I], [-lr I, 0]]:
    # [[RA (RB - lr CB)^T - lr CA RB^T,  -lr RA RB2^T], [-lr RA2 RB^T,  0]]
    top = torch.cat([fr.RA @ (fr.RB - lr_t * CB).mT - lr_t * (CA @ fr.RB.mT), -lr_t * (fr.RA @ RB2.mT)], dim=-1)
    bottom = torch.cat([-lr_t * (RA2 @ fr.RB.mT), torch.zeros_like(RA2)], dim=-1)
    return torch.cat([top, bottom], dim=-2), (fr.QA, QA2, fr.QB, QB2)


def retraction_factors(bases: tuple[Tensor, ...], svd: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The balanced rank-r factors from :func:`retraction_core`'s bases and the SVD ``(Uc, S, Vch)`` of its core."""
    QA, QA2, QB, QB2 = bases
    Uc, S, Vch = svd
    r = QA.shape[-1]
    root = S[..., :r].clamp_min(0.0).sqrt().unsqueeze(-2)
    Vc = Vch[..., :r, :].mT
    A_new = (QA @ Uc[..., :r, :r] + QA2 @ Uc[..., r:, :r]) * root
    B_new = (QB @ Vc[..., :r, :] + QB2 @ Vc[..., r:, :]) * root
    return A_new, B_new


def procrustes_align(
    A_new: Tensor, B_new: Tensor, A_ref: Tensor, B_ref: Tensor
) -> tuple[Tensor, Tensor]:
    """Rotate ``(A_new, B_new)`` by the orthogonal ``Q`` closest to the reference factors.

    ``Q = argmin ||A_new Q - A_ref||^2 + ||B_new Q - B_ref||^2`` over orthogonal Q (a gauge change:
    Z, the projectors and the balance are unchanged): ``Q = U V^T`` from the SVD of :func:`procrustes_cross`.
    """
    return procrustes_rotate(A_new, B_new, torch.linalg.svd(procrustes_cross(A_new, B_new, A_ref, B_ref)))


def procrustes_cross(A_new: Tensor, B_new: Tensor, A_ref: Tensor, B_ref: Tensor) -> Tensor:
    """The (.., r, r) matrix whose SVD ``U S V^T`` gives :func:`procrustes_align`'s rotation ``Q = U V^T``."""
    return A_new.mT @ A_ref + B_new.mT @ B_ref


def procrustes_rotate(A_new: Tensor, B_new: Tensor, svd: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`procrustes_align` from the SVD ``(U, S, Vh)`` of :func:`procrustes_cross`: ``(A_new Q, B_new Q)``."""
    U, _, Vh = svd
    Q = U @ Vh
    return A_new @ Q, B_new @ Q


def balance(A: Tensor, B: Tensor, qr: str | None = None) -> tuple[Tensor, Tensor]:
    """Balanced factors of the same Z (``A^T A = B^T B``), unique up to an orthogonal rotation."""
    fr = frame(A, B, qr)
    U, S, Vh = torch.linalg.svd(fr.RA @ fr.RB.mT)
    root = S.sqrt().unsqueeze(-2)
    return (fr.QA @ U) * root, (fr.QB @ Vh.mT) * root


def tangent_to_dense(A: Tensor, B: Tensor, dA: Tensor, dB: Tensor) -> Tensor:
    """``dA B^T + A dB^T`` as a dense matrix (reference use, small sizes)."""
    return dA @ B.mT + A @ dB.mT
