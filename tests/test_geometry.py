"""Tests for ``prismdp.geometry`` against dense float64 references (small sizes).

Every formula in the module is checked against the dense m x n object it stands for: the tangent projector
``P(G) = G - (I - Pi_A) G (I - Pi_B)`` built from pseudo-inverses (paper eq. ``tangent_proj``), the canonical
lift (eq. ``canonical``), the intrinsic norm (eq. ``tangent_norm``), the tangent noise (eq. ``noise_form``,
Thm. ``noise_energy``), the truncated-SVD retraction (eq. ``retraction``, Prop. ``retract_error``), the
Procrustes alignment and balancing, their GL(r) gauge invariance, ill-conditioned factors and float32.

Statistical tests use seeded generators (so they are deterministic) and tolerances derived from the sampling
error computed from the sample itself, so that a correct implementation passes with overwhelming probability
for *any* seed while a wrong normalisation fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from prismdp.geometry import (
    QR_METHODS,
    Frame,
    balance,
    canonical_lift,
    cholesky_qr,
    default_qr,
    frame,
    lift_with_frame,
    noise_with_frame,
    per_example_norm_sq_balanced,
    procrustes_align,
    projected_grad_norm_sq,
    projected_grad_norm_sq_balanced,
    retract,
    sample_tangent_noise,
    tangent_norm_sq,
    tangent_project,
    tangent_to_dense,
    thin_qr,
)

F64 = torch.float64
F32 = torch.float32

# (m, n, r): both orientations, r = 1..3, and 2r > m (m = 5, r = 3) for the retraction's (m, 2r) QR.
SIZES = [(5, 7, 1), (6, 5, 2), (8, 12, 3), (5, 9, 3), (12, 10, 2), (7, 7, 3)]
SIZE_IDS = [f"m{m}-n{n}-r{r}" for m, n, r in SIZES]


# ----------------------------------------------------------------------------------------------------------
# helpers (dense float64 references)
# ----------------------------------------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=dtype)


def rand_orth(g: torch.Generator, k: int, r: int) -> torch.Tensor:
    Q, R = torch.linalg.qr(randn(g, k, r))
    return Q * torch.sign(torch.diagonal(R)).unsqueeze(0)


def rand_factors(g: torch.Generator, m: int, n: int, r: int, batch: tuple[int, ...] = ()):
    """Well-conditioned but far from orthonormal / balanced factors (column scales 0.5..3, mixed)."""
    scale = torch.linspace(0.5, 3.0, r, dtype=F64)
    mix = torch.eye(r, dtype=F64) + 0.5 * torch.triu(randn(g, r, r), diagonal=1)
    A = (randn(g, *batch, m, r) * scale) @ mix
    B = (randn(g, *batch, n, r) * scale.flip(0)) @ mix.mT
    return A, B


def rand_gl(g: torch.Generator, r: int, cond: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Random invertible R with condition number ``cond`` and its exact inverse-transpose R^-T."""
    U, V = rand_orth(g, r, r), rand_orth(g, r, r)
    s = torch.logspace(0.0, -math.log10(cond), r, dtype=F64) if r > 1 else torch.ones(1, dtype=F64)
    s = s * 1.7  # not scale-free either
    return (U * s) @ V.mT, (U / s) @ V.mT


def pinv_projector(X: torch.Tensor) -> torch.Tensor:
    """Pi_X = X (X^T X)^+ X^T (paper eq. ``projectors``), via torch.linalg.pinv."""
    return X @ torch.linalg.pinv(X.mT @ X) @ X.mT


def dense_project(PiA: torch.Tensor, PiB: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """G - (I - Pi_A) G (I - Pi_B)."""
    Im = torch.eye(PiA.shape[-1], dtype=PiA.dtype)
    In = torch.eye(PiB.shape[-1], dtype=PiB.dtype)
    return G - (Im - PiA) @ G @ (In - PiB)


def dense_tangent(A, B, dA, dB):
    return dA @ B.mT + A @ dB.mT


def fro_sq(X: torch.Tensor) -> torch.Tensor:
    return X.square().sum((-2, -1))


def rel_err(x: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float | None = None) -> float:
    x, ref = x.to(F64), ref.to(F64)
    den = ref.norm() if scale is None else torch.as_tensor(scale, dtype=F64)
    return float((x - ref).norm() / den)


def projector_matrix(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Matrix (mn x mn, row-major vec) of G -> tangent_project(A, B, G), built from the basis matrices."""
    m, n = A.shape[-2], B.shape[-2]
    basis = torch.eye(m * n, dtype=A.dtype).reshape(m * n, m, n)
    return tangent_project(A, B, basis).reshape(m * n, m * n).mT  # column j = vec(P(E_j))


def tangent_basis(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (mn x d) of the tangent space: eigenvectors of the dense pinv projector, eigenvalue 1."""
    m, n = A.shape[-2], B.shape[-2]
    PiA, PiB = pinv_projector(A), pinv_projector(B)
    basis = torch.eye(m * n, dtype=F64).reshape(m * n, m, n)
    P = dense_project(PiA, PiB, basis).reshape(m * n, m * n).mT
    evals, evecs = torch.linalg.eigh(0.5 * (P + P.mT))
    return evecs[:, evals > 0.5]


def truncated_svd(X: torch.Tensor, r: int):
    U, S, Vh = torch.linalg.svd(X)
    return (U[..., :r] * S[..., None, :r]) @ Vh[..., :r, :], S


def ill_factors(g: torch.Generator, m: int, n: int, r: int, kind: str, cond: float = 1e6):
    """Factors with condition number ``cond`` and exact orthonormal bases of their column spaces.

    ``independent``: A = U_A diag(s) V_A^T, B = U_B diag(s) V_B^T with s from 1 to 1/cond (Z itself is then
    ill-conditioned, down to 1/cond^2).  ``gauge``: A = A0 R, B = B0 R^-T with well-conditioned A0, B0 and
    cond(R) = cond, so Z = A0 B0^T is benign while each factor has condition number ~cond.
    """
    s = torch.logspace(0.0, -math.log10(cond), r, dtype=F64)
    if kind == "independent":
        UA, UB = rand_orth(g, m, r), rand_orth(g, n, r)
        A = (UA * s) @ rand_orth(g, r, r).mT
        B = (UB * s) @ rand_orth(g, r, r).mT
    else:
        A0, B0 = randn(g, m, r), randn(g, n, r)
        R, R_inv_t = rand_gl(g, r, cond)
        A, B = A0 @ R, B0 @ R_inv_t
        UA, UB = torch.linalg.qr(A0)[0], torch.linalg.qr(B0)[0]
    return A, B, UA, UB


def cov_identity_tol(draws: int) -> float:
    """Tolerance for max |C - I| of an empirical covariance of N(0, I_d) coordinates from ``draws`` draws.

    Entry (j, k) of C = c^T c / draws has standard deviation 1/sqrt(draws) off the diagonal and
    sqrt(2/draws) on it; with d(d+1)/2 <= 200 distinct entries and (near-)Gaussian fluctuations, a 6-sigma
    band is exceeded with probability < 200 * 2e-9 = 4e-7.  So 6 * sqrt(2 / draws).
    """
    return 6.0 * math.sqrt(2.0 / draws)


# ----------------------------------------------------------------------------------------------------------
# frame / tangent_to_dense
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qr", QR_METHODS)
@pytest.mark.parametrize("batch", [(), (3,)])
def test_frame_is_thin_qr(batch, qr):
    """Both thin QRs in float64: Householder's Q orthonormal to ~eps, CholeskyQR's to its shift (~1e-13 here)."""
    A, B = rand_factors(gen(1), 8, 6, 3, batch)
    fr = frame(A, B, qr)
    assert isinstance(fr, Frame)
    eye = torch.eye(3, dtype=F64)
    for Q, R, X in ((fr.QA, fr.RA, A), (fr.QB, fr.RB, B)):
        assert Q.shape == X.shape and R.shape == (*batch, 3, 3)
        orth_tol = 1e-13 if qr == "householder" else 1e-12
        torch.testing.assert_close(Q.mT @ Q, eye.expand(*batch, 3, 3), rtol=0, atol=orth_tol)
        torch.testing.assert_close(Q @ R, X, rtol=0, atol=1e-12)
        assert torch.equal(R, torch.triu(R))


def _conditioned(g: torch.Generator, batch: int, m: int, r: int, cond: float) -> torch.Tensor:
    """(batch, m, r) float64 matrices with singular values logspaced from 1 to 1 / cond."""
    U = torch.linalg.qr(randn(g, batch, m, r))[0]
    V = torch.linalg.qr(randn(g, batch, r, r))[0]
    return (U * torch.logspace(0.0, -math.log10(cond), r, dtype=F64)) @ V.mT


@pytest.mark.parametrize("cond", [1e1, 1e3, 1e5])
def test_cholesky_qr_float32_beats_householder_on_ill_conditioned_factors(cond):
    """The GPU's default thin QR on float32 factors (the working dtype): Q orthonormal to < 2e-8 (float64 inside)
    where float32 Householder reaches ~5e-7, Q R = X to float32 rounding, R upper triangular.  One pass instead of
    two leaves |Q^T Q - I| ~ u cond^2 (1e-6 at cond 1e5) and fails."""
    X = _conditioned(gen(3), 4, 300, 8, cond).to(F32)
    Q, R = cholesky_qr(X)
    assert Q.dtype == R.dtype == F32 and Q.shape == X.shape and R.shape == (4, 8, 8)
    assert torch.equal(R, torch.triu(R))
    Qd = Q.double()
    orth = float((Qd.mT @ Qd - torch.eye(8, dtype=F64)).abs().max())
    assert orth < 2e-8, orth
    assert float((Qd @ R.double() - X.double()).norm() / X.double().norm()) < 1e-6
    Qh = torch.linalg.qr(X)[0].double()
    assert orth < float((Qh.mT @ Qh - torch.eye(8, dtype=F64)).abs().max())


@pytest.mark.parametrize("case", ["zero", "rank-2-of-4", "one-zero-column"])
def test_cholesky_qr_rank_deficient_is_finite_and_exact(case):
    """What the retraction's new directions can be (a direction inside the frame's span leaves nothing): no NaN or
    inf (the shift keeps each Cholesky factorisation defined; without it a singular Gram matrix fails), Q R = X, and
    the missing directions carry no weight: R's trailing diagonal ~ 0."""
    g = gen(4)
    X = {"zero": torch.zeros(3, 40, 4, dtype=F64),
         "rank-2-of-4": randn(g, 3, 40, 2) @ randn(g, 3, 2, 4),
         "one-zero-column": torch.cat([randn(g, 3, 40, 3), torch.zeros(3, 40, 1, dtype=F64)], -1)}[case]
    Q, R = cholesky_qr(X)
    assert bool(torch.isfinite(Q).all()) and bool(torch.isfinite(R).all())
    torch.testing.assert_close(Q @ R, X, rtol=0, atol=1e-12 * max(float(X.norm()), 1.0))
    rank = {"zero": 0, "rank-2-of-4": 2, "one-zero-column": 3}[case]
    assert float(R.diagonal(dim1=-2, dim2=-1)[..., rank:].abs().max()) < 1e-6 * max(float(X.norm()), 1.0)
    if rank:
        eye = torch.eye(rank, dtype=F64)
        torch.testing.assert_close(Q[..., :rank].mT @ Q[..., :rank], eye.expand(3, rank, rank), rtol=0, atol=1e-12)


def test_default_qr_by_device_and_dtype():
    """CholeskyQR where torch.linalg.qr launches kernels per matrix (CUDA, float32 and below); Householder on the CPU
    and in float64.  The default on the CPU is what every other test here runs."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_qr(cuda, F32) == default_qr(cuda, torch.bfloat16) == "cholesky"
    assert default_qr(cuda, F64) == default_qr(cpu, F32) == default_qr(cpu, F64) == "householder"
    with pytest.raises(ValueError, match="choose one of"):
        thin_qr(torch.ones(3, 2), "givens")


def test_tangent_to_dense_batched():
    g = gen(2)
    A, B = rand_factors(g, 7, 5, 2)
    dA, dB = randn(g, 4, 7, 2), randn(g, 4, 5, 2)
    out = tangent_to_dense(A, B, dA, dB)
    assert out.shape == (4, 7, 5)
    for i in range(4):
        ref = torch.einsum("ik,jk->ij", dA[i], B) + torch.einsum("ik,jk->ij", A, dB[i])
        torch.testing.assert_close(out[i], ref, rtol=1e-13, atol=1e-13)


# ----------------------------------------------------------------------------------------------------------
# tangent_project (eq. tangent_proj)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_tangent_project_matches_dense_pinv(m, n, r):
    g = gen(10 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    G = randn(g, m, n)
    ref = dense_project(pinv_projector(A), pinv_projector(B), G)
    out = tangent_project(A, B, G)
    assert out.dtype == F64 and out.shape == (m, n)
    assert rel_err(out, ref, G.norm()) < 1e-12
    # non-trivial: the projection removes a real part of G, and keeps G B and G^T A (P(G) B = G B).
    assert (G - ref).norm() > 0.1 * G.norm()
    torch.testing.assert_close(out @ B, G @ B, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(out.mT @ A, G.mT @ A, rtol=1e-11, atol=1e-11)
    # batched G (leading dims) == loop
    Gb = randn(g, 3, m, n)
    outb = tangent_project(A, B, Gb)
    for i in range(3):
        torch.testing.assert_close(outb[i], tangent_project(A, B, Gb[i]), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_tangent_project_idempotent_and_self_adjoint(m, n, r):
    g = gen(20 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    G, H = randn(g, m, n), randn(g, m, n)
    PG, PH = tangent_project(A, B, G), tangent_project(A, B, H)
    assert rel_err(tangent_project(A, B, PG), PG) < 1e-12
    lhs, rhs = (PG * H).sum(), (G * PH).sum()
    assert abs(float(lhs - rhs)) < 1e-12 * float(G.norm() * H.norm())
    # orthogonality of the residual: <G - P(G), P(H)> = 0
    assert abs(float(((G - PG) * PH).sum())) < 1e-12 * float(G.norm() * H.norm())


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_tangent_projector_rank_is_manifold_dimension(m, n, r):
    A, B = rand_factors(gen(30 + m + 13 * n + 100 * r), m, n, r)
    P = projector_matrix(A, B)
    d = r * (m + n - r)
    assert int(torch.linalg.matrix_rank(P)) == d
    assert abs(float(torch.trace(P)) - d) < 1e-10
    torch.testing.assert_close(P, P.mT, rtol=0, atol=1e-12)
    torch.testing.assert_close(P @ P, P, rtol=0, atol=1e-12)
    evals = torch.linalg.eigvalsh(0.5 * (P + P.mT))
    expected = torch.cat([torch.zeros(m * n - d, dtype=F64), torch.ones(d, dtype=F64)])
    torch.testing.assert_close(evals, expected, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# canonical_lift (eq. canonical)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_canonical_lift_reproduces_projection(m, n, r):
    g = gen(40 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    G = randn(g, m, n)
    dA, dB = canonical_lift(A, B, G @ B, G.mT @ A)
    assert dA.shape == (m, r) and dB.shape == (n, r)
    ref = dense_project(pinv_projector(A), pinv_projector(B), G)
    assert rel_err(dense_tangent(A, B, dA, dB), ref, G.norm()) < 1e-12
    # lift_with_frame is the same map given a precomputed frame
    dA2, dB2 = lift_with_frame(frame(A, B), G @ B, G.mT @ A)
    torch.testing.assert_close(dA2, dA, rtol=0, atol=0)
    torch.testing.assert_close(dB2, dB, rtol=0, atol=0)
    # the lift depends on the tangent vector only: lifting P(G) gives the same pair
    dA3, dB3 = canonical_lift(A, B, ref @ B, ref.mT @ A)
    torch.testing.assert_close(dA3, dA, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dB3, dB, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_canonical_lift_matches_paper_pinv_formula(m, n, r):
    g = gen(50 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    G = randn(g, m, n)
    gA, gB = G @ B, G.mT @ A
    M_pinv, N_pinv = torch.linalg.pinv(A.mT @ A), torch.linalg.pinv(B.mT @ B)
    PiA, PiB = pinv_projector(A), pinv_projector(B)
    dA_ref = gA @ N_pinv - 0.5 * PiA @ gA @ N_pinv
    dB_ref = gB @ M_pinv - 0.5 * PiB @ gB @ M_pinv
    dA, dB = canonical_lift(A, B, gA, gB)
    assert rel_err(dA, dA_ref) < 1e-10
    assert rel_err(dB, dB_ref) < 1e-10


@pytest.mark.parametrize("factor_batch", [False, True], ids=["shared-factors", "batched-factors"])
def test_canonical_lift_batched_matches_loop(factor_batch):
    g = gen(60)
    m, n, r, b = 9, 6, 3, 4
    A, B = rand_factors(g, m, n, r, (b,) if factor_batch else ())
    G = randn(g, b, m, n)
    gA, gB = G @ B, G.mT @ A
    dA, dB = canonical_lift(A, B, gA, gB)
    assert dA.shape == (b, m, r) and dB.shape == (b, n, r)
    for i in range(b):
        Ai, Bi = (A[i], B[i]) if factor_batch else (A, B)
        dAi, dBi = canonical_lift(Ai, Bi, gA[i], gB[i])
        torch.testing.assert_close(dA[i], dAi, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dB[i], dBi, rtol=1e-12, atol=1e-12)
        ref = dense_project(pinv_projector(Ai), pinv_projector(Bi), G[i])
        assert rel_err(dense_tangent(Ai, Bi, dA[i], dB[i]), ref, G[i].norm()) < 1e-12


# ----------------------------------------------------------------------------------------------------------
# tangent_norm_sq (eq. tangent_norm) and projected_grad_norm_sq
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("factor_batch", [False, True], ids=["shared-factors", "batched-factors"])
def test_tangent_norm_sq_arbitrary_lifts(m, n, r, factor_batch):
    g = gen(70 + m + 13 * n + 100 * r + factor_batch)
    b = 5
    A, B = rand_factors(g, m, n, r, (b,) if factor_batch else ())
    dA, dB = randn(g, b, m, r), randn(g, b, n, r)  # arbitrary lifts, not canonical
    # include a lift with a large vertical (gauge) component: (A W, -B W^T) adds nothing to dZ
    W = 5.0 * randn(g, r, r)
    dA[0] = dA[0] + (A[0] if factor_batch else A) @ W
    dB[0] = dB[0] - (B[0] if factor_batch else B) @ W.mT
    out = tangent_norm_sq(A, B, dA, dB)
    assert out.shape == (b,)
    ref = fro_sq(dense_tangent(A, B, dA, dB))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=0)
    # a pure vertical lift has zero intrinsic norm
    A0, B0 = (A[0], B[0]) if factor_batch else (A, B)
    # (up to rounding relative to the two cancelling parts, ||dA B^T||^2 = ||A dB^T||^2 = ||A W B^T||^2)
    parts = float(fro_sq(A0 @ W @ B0.mT))
    assert abs(float(tangent_norm_sq(A0, B0, A0 @ W, -B0 @ W.mT))) < 1e-13 * parts


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_projected_grad_norm_sq_matches_dense(m, n, r):
    g = gen(80 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    G = randn(g, 6, m, n)
    G[1] = G[1] * 1e-3  # scale spread across the batch
    fr = frame(A, B)
    out = projected_grad_norm_sq(fr, G @ B, G.mT @ A)
    assert out.shape == (6,)
    ref = fro_sq(dense_project(pinv_projector(A), pinv_projector(B), G))
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=0)
    assert torch.all(ref < 0.99 * fro_sq(G))  # the projection does remove energy
    # and equals the intrinsic norm of the canonical lift
    dA, dB = canonical_lift(A, B, G @ B, G.mT @ A)
    torch.testing.assert_close(tangent_norm_sq(A, B, dA, dB), ref, rtol=1e-11, atol=0)


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_projected_grad_norm_sq_balanced_matches_dense_with_group_broadcast(m, n, r):
    """The Gram form at balanced factors, as PRISM calls it: a frame of k stacked modules (k, 1, ., r) against
    per-example gradients (k, b, ., r)."""
    g = gen(90 + m + 13 * n + 100 * r)
    A, B = balance(*rand_factors(g, m, n, r, (3,)))
    G = randn(g, 3, 5, m, n)
    G[:, 1] *= 1e-3
    fr = frame(A, B)
    out = projected_grad_norm_sq_balanced(Frame(*(t.unsqueeze(1) for t in fr)), G @ B.unsqueeze(1),
                                          G.mT @ A.unsqueeze(1))
    assert out.shape == (3, 5)
    # PRISM's call: the same gradients rank-major (k, b, r, .), as the gradient sampler writes them
    rank_major = per_example_norm_sq_balanced(fr, (G @ B.unsqueeze(1)).mT.contiguous(),
                                              (G.mT @ A.unsqueeze(1)).mT.contiguous())
    for k in range(3):
        ref = fro_sq(dense_project(pinv_projector(A[k]), pinv_projector(B[k]), G[k]))
        torch.testing.assert_close(out[k], ref, rtol=1e-11, atol=0)
        torch.testing.assert_close(rank_major[k], ref, rtol=1e-11, atol=0)


def test_projected_grad_norm_sq_batched_factors():
    g = gen(81)
    A, B = rand_factors(g, 7, 9, 2, (3,))
    G = randn(g, 3, 7, 9)
    out = projected_grad_norm_sq(frame(A, B), G @ B, G.mT @ A)
    for i in range(3):
        ref = fro_sq(dense_project(pinv_projector(A[i]), pinv_projector(B[i]), G[i]))
        torch.testing.assert_close(out[i], ref, rtol=1e-11, atol=0)


def test_projected_grad_norm_sq_float32_ill_conditioned_balanced_point():
    """What PRISM computes in training: float32, balanced factors, singular values spread over 1e3, gradients
    mostly inside the tangent space's A-part (the cancelling case) -- against the dense float64 projection."""
    g = gen(83)
    m, n, r = 40, 30, 4
    U, _ = torch.linalg.qr(randn(g, m, r))
    V, _ = torch.linalg.qr(randn(g, n, r))
    s = torch.tensor([1e3, 30.0, 1.0, 1.0], dtype=F64)
    A, B = U * s.sqrt(), V * s.sqrt()
    G = U @ randn(g, 5, r, n) + 1e-3 * randn(g, 5, m, n)  # Pi_A G dominates
    ref = fro_sq(dense_project(pinv_projector(A), pinv_projector(B), G))
    f32 = torch.float32
    for norm_sq in (projected_grad_norm_sq, projected_grad_norm_sq_balanced):
        out = norm_sq(frame(A.to(f32), B.to(f32)), (G @ B).to(f32), (G.mT @ A).to(f32))
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=0)


def test_projected_grad_norm_sq_zero_gradient_is_zero():
    A, B = rand_factors(gen(82), 6, 8, 2)
    z = torch.zeros(6, 8, dtype=F64)
    assert float(projected_grad_norm_sq(frame(A, B), z @ B, z.mT @ A)) == 0.0


# ----------------------------------------------------------------------------------------------------------
# sample_tangent_noise / noise_with_frame (eq. noise_form, Thm. noise_energy)
# ----------------------------------------------------------------------------------------------------------


def draw_noise(A, B, draws: int, seed: int, dtype=F64):
    """``draws`` independent samples, via one call on factors expanded along a leading batch dim."""
    m, r = A.shape[-2:]
    n = B.shape[-2]
    XiA, XiB = sample_tangent_noise(
        A.to(dtype).expand(draws, m, r), B.to(dtype).expand(draws, n, r), generator=gen(seed)
    )
    return XiA, XiB


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_noise_is_tangent(m, n, r):
    A, B = rand_factors(gen(90 + m + 13 * n + 100 * r), m, n, r)
    XiA, XiB = sample_tangent_noise(A, B, generator=gen(91))
    assert XiA.shape == (m, r) and XiB.shape == (n, r) and XiA.dtype == F64
    N = dense_tangent(A, B, XiA, XiB)
    ref = dense_project(pinv_projector(A), pinv_projector(B), N)
    assert rel_err(N, ref) < 1e-12
    # the A-part is orthogonal to col(A) (eq. noise_form: (I - Pi_A) Omega_A ...)
    assert float((A.mT @ XiA).norm()) < 1e-12 * float(A.norm() * XiA.norm())


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_noise_energy_matches_theorem(m, n, r):
    draws = 4000
    A, B = rand_factors(gen(100 + m + 13 * n + 100 * r), m, n, r)
    XiA, XiB = draw_noise(A, B, draws, seed=101 + m)
    energy = fro_sq(dense_tangent(A, B, XiA, XiB))
    d = r * (m + n - r)
    se = float(energy.std()) / math.sqrt(draws)
    assert abs(float(energy.mean()) - d) < 5 * se
    # the SE is honest: ||N||^2 ~ chi^2_d has variance 2d
    assert 0.8 * math.sqrt(2 * d / draws) < se < 1.25 * math.sqrt(2 * d / draws)
    # ... and the test discriminates: e.g. forgetting the (I - Pi_A) gives r(m + n), which differs from d by
    # r^2, more than 5 SE for r >= 2 at this number of draws
    if r >= 2:
        assert r * r > 5 * se


def _covariance_deviation(N: torch.Tensor, E: torch.Tensor) -> float:
    coords = N.reshape(N.shape[0], -1) @ E  # (draws, d): coordinates in an orthonormal tangent basis
    C = coords.mT @ coords / coords.shape[0]
    return float((C - torch.eye(E.shape[1], dtype=F64)).abs().max())


def test_noise_is_isotropic_on_tangent_space():
    m, n, r, draws = 6, 5, 2, 20000
    A, B = rand_factors(gen(110), m, n, r)
    E = tangent_basis(A, B)
    assert E.shape == (m * n, r * (m + n - r))
    XiA, XiB = draw_noise(A, B, draws, seed=111)
    N = dense_tangent(A, B, XiA, XiB)
    tol = cov_identity_tol(draws)
    # the draws live in the tangent space: no energy outside span(E)
    flat = N.reshape(draws, -1)
    resid = flat - (flat @ E) @ E.mT
    assert float(resid.norm()) < 1e-10 * float(flat.norm())
    coords = flat @ E
    assert float(coords.mean(0).abs().max()) < 6.0 / math.sqrt(draws)
    assert _covariance_deviation(N, E) < tol
    # Power check: the same statistic rejects plausible mis-normalisations of eq. noise_form,
    # e.g. whitening with N^-1 / M^-1 instead of N^-1/2 / M^-1/2 (same Omega draws).
    fr = frame(A, B)
    g = gen(111)
    omega_A, omega_B = randn(g, draws, m, r), randn(g, draws, n, r)
    M, Nn = A.mT @ A, B.mT @ B
    PiA = fr.QA @ fr.QA.mT
    bad_A = (omega_A - PiA @ omega_A) @ torch.linalg.inv(Nn)
    bad_B = omega_B @ torch.linalg.inv(M)
    assert _covariance_deviation(dense_tangent(A, B, bad_A, bad_B), E) > 5 * tol
    # ...and naive factor-space noise (Omega_A B^T + A Omega_B^T) is not isotropic either
    assert _covariance_deviation(dense_tangent(A, B, omega_A, omega_B), E) > 5 * tol


def test_noise_rank_space_second_moments():
    m, n, r, draws = 7, 6, 3, 20000
    A, B = rand_factors(gen(120), m, n, r)
    XiA, XiB = draw_noise(A, B, draws, seed=121)
    M_inv = torch.linalg.inv(A.mT @ A)
    N_inv = torch.linalg.inv(B.mT @ B)
    for Xi, expected in ((XiA, (m - r) * N_inv), (XiB, n * M_inv)):
        S = Xi.mT @ Xi  # (draws, r, r)
        mean, se = S.mean(0), S.std(0) / math.sqrt(draws)
        assert torch.all((mean - expected).abs() < 5 * se), (mean, expected, se)
        # discriminates against the obvious alternatives (m N^-1 / (n - r) M^-1 etc.): those differ from
        # the expected value by expected * r / (m - r) or so, far more than 5 SE on the diagonal
        assert torch.all(torch.diagonal(expected) * r / (m + n) > 5 * torch.diagonal(se))


@pytest.mark.parametrize("dtype", [F64, F32])
def test_noise_uses_exactly_m_plus_n_times_r_normals(dtype):
    m, n, r = 8, 5, 3
    A, B = rand_factors(gen(130), m, n, r)
    A, B = A.to(dtype), B.to(dtype)
    g = gen(131)
    clone = torch.Generator().set_state(g.get_state())
    XiA, XiB = sample_tangent_noise(A, B, generator=g)
    omega_A = torch.randn(A.shape, generator=clone, dtype=dtype)
    omega_B = torch.randn(B.shape, generator=clone, dtype=dtype)
    # same generator state afterwards => the sampler consumed exactly these (m + n) r normals
    assert torch.equal(g.get_state(), clone.get_state())
    assert torch.equal(torch.randn(7, generator=g), torch.randn(7, generator=clone))
    # ...and they are precisely what it used (eq. noise_form through noise_with_frame)
    XiA2, XiB2 = noise_with_frame(frame(A, B), omega_A, omega_B)
    torch.testing.assert_close(XiA, XiA2, rtol=0, atol=0)
    torch.testing.assert_close(XiB, XiB2, rtol=0, atol=0)


def test_noise_reproducible_with_seed():
    A, B = rand_factors(gen(140), 9, 7, 2)
    a1, b1 = sample_tangent_noise(A, B, generator=gen(5))
    a2, b2 = sample_tangent_noise(A, B, generator=gen(5))
    a3, b3 = sample_tangent_noise(A, B, generator=gen(6))
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert not torch.allclose(a1, a3) and not torch.allclose(b1, b3)


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_noise_with_frame_matches_paper_formula_in_law(m, n, r):
    """noise_with_frame(Omega) equals eq. noise_form applied to Omega rotated by a fixed orthogonal O.

    Xi_A = (I - Pi_A) Omega_A R_B^-T and eq. noise_form's (I - Pi_A) Omega_A' N^-1/2 coincide for
    Omega_A' = Omega_A O_B with O_B = R_B^-T N^1/2 orthogonal (polar factor), likewise for B: same law.
    """
    g = gen(150 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    fr = frame(A, B)
    omega_A, omega_B = randn(g, m, r), randn(g, n, r)
    XiA, XiB = noise_with_frame(fr, omega_A, omega_B)

    def sqrtm(S):
        w, V = torch.linalg.eigh(S)
        return (V * w.sqrt()) @ V.mT, (V / w.sqrt()) @ V.mT

    M_half, M_mhalf = sqrtm(A.mT @ A)
    N_half, N_mhalf = sqrtm(B.mT @ B)
    O_B = torch.linalg.solve_triangular(fr.RB.mT, N_half, upper=False)  # R_B^-T N^1/2
    O_A = torch.linalg.solve_triangular(fr.RA.mT, M_half, upper=False)
    eye = torch.eye(r, dtype=F64)
    torch.testing.assert_close(O_B.mT @ O_B, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(O_A.mT @ O_A, eye, rtol=0, atol=1e-12)
    PiA = pinv_projector(A)
    XiA_paper = (torch.eye(m, dtype=F64) - PiA) @ (omega_A @ O_B) @ N_mhalf
    XiB_paper = (omega_B @ O_A) @ M_mhalf
    torch.testing.assert_close(XiA, XiA_paper, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(XiB, XiB_paper, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# retract (eq. retraction, Prop. retract_error)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("lr", [1e-3, 0.1, 1.0])
def test_retract_matches_truncated_svd(m, n, r, lr):
    g = gen(160 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    dA, dB = randn(g, m, r), randn(g, n, r)
    X = A @ B.mT - lr * dense_tangent(A, B, dA, dB)
    ref, S = truncated_svd(X, r)
    assert float(S[r - 1] - S[r]) > 1e-3 * float(S[0])  # truncation well defined for this draw
    An, Bn = retract(A, B, dA, dB, lr)
    assert An.shape == (m, r) and Bn.shape == (n, r)
    assert rel_err(An @ Bn.mT, ref, X.norm()) < 1e-12
    # balanced, with Gram = diag of the top-r singular values (descending)
    torch.testing.assert_close(An.mT @ An, torch.diag(S[:r]), rtol=0, atol=1e-12 * float(S[0]))
    torch.testing.assert_close(Bn.mT @ Bn, torch.diag(S[:r]), rtol=0, atol=1e-12 * float(S[0]))
    # tensor learning rate behaves like the float (a float64 tensor: a float32 0.1 is a different number)
    An2, Bn2 = retract(A, B, dA, dB, torch.tensor(lr, dtype=F64))
    torch.testing.assert_close(An2 @ Bn2.mT, An @ Bn.mT, rtol=1e-13, atol=1e-13)


def test_retract_distortion_is_second_order():
    g = gen(170)
    worst = 0.0
    for m, n, r in SIZES:
        for _ in range(4):
            A, B = rand_factors(g, m, n, r)
            dA, dB = randn(g, m, r), randn(g, n, r)
            bilinear = float((dA @ dB.mT).norm())
            for lr in (1e-3, 1e-2, 0.1, 0.5, 2.0):
                X = A @ B.mT - lr * dense_tangent(A, B, dA, dB)
                An, Bn = retract(A, B, dA, dB, lr)
                dist = float((An @ Bn.mT - X).norm())
                slack = 1e-12 * float(X.norm())
                assert dist <= lr**2 * bilinear + slack, (m, n, r, lr, dist, lr**2 * bilinear)
                # the distortion is exactly the truncated-SVD tail, which is generally nonzero
                _, S = truncated_svd(X, r)
                assert abs(dist - float(S[r:].norm())) <= slack + 1e-12 * dist
                worst = max(worst, dist / (lr**2 * bilinear))
    assert worst > 0.05  # the bound is not vacuous on these cases (and the check above is not trivial)


def test_retract_zero_step_returns_same_point_balanced():
    g = gen(175)
    A, B = rand_factors(g, 8, 6, 3)
    z = torch.zeros_like
    An, Bn = retract(A, B, z(A), z(B), 0.3)
    assert rel_err(An @ Bn.mT, A @ B.mT) < 1e-13
    torch.testing.assert_close(An.mT @ An, Bn.mT @ Bn, rtol=0, atol=1e-12)


def _stacked_qr_retract(A, B, dA, dB, lr):
    """The retraction as first written: thin QR of the whole (m, 2r) / (n, 2r) stacks."""
    r = A.shape[-1]
    Qu, Ru = torch.linalg.qr(torch.cat([A, dA], dim=-1))
    Qv, Rv = torch.linalg.qr(torch.cat([B, dB], dim=-1))
    core = Ru[..., :r] @ (Rv[..., :r] - lr * Rv[..., r:]).mT - lr * (Ru[..., r:] @ Rv[..., :r].mT)
    Uc, S, Vch = torch.linalg.svd(core)
    root = S[..., :r].sqrt().unsqueeze(-2)
    return (Qu @ Uc[..., :r]) * root, (Qv @ Vch[..., :r, :].mT) * root


@pytest.mark.parametrize("qr", QR_METHODS)
@pytest.mark.parametrize("case", ["random", "dA-in-span", "dB-in-span", "both-in-span", "dA-zero", "tiny-normal"])
def test_retract_extending_the_frame_matches_truncated_svd_in_degenerate_directions(case, qr):
    """The retraction orthogonalises only the new directions against the frame of (A, B): exact (float64, against
    the dense truncated SVD and the stacked-QR retraction) also when a direction has no component outside the
    factor's column space, none at all, or one ~1e-9 of its size; a precomputed frame gives the same result.  With
    either thin QR (CholeskyQR's basis of a rank-deficient new block is not orthonormal, but carries no weight)."""
    g = gen(185)
    m, n, r, lr = 11, 9, 3, 0.3
    A, B = rand_factors(g, m, n, r)
    dA, dB = randn(g, m, r), randn(g, n, r)
    if case in ("dA-in-span", "both-in-span"):
        dA = A @ randn(g, r, r)
    if case in ("dB-in-span", "both-in-span"):
        dB = B @ randn(g, r, r)
    if case == "dA-zero":
        dA = torch.zeros_like(dA)
    if case == "tiny-normal":
        QA, _ = torch.linalg.qr(A)
        dA = A @ randn(g, r, r) + 1e-9 * (dA - QA @ (QA.mT @ dA))
    X = A @ B.mT - lr * dense_tangent(A, B, dA, dB)
    ref, S = truncated_svd(X, r)
    An, Bn = retract(A, B, dA, dB, lr, qr=qr)
    assert rel_err(An @ Bn.mT, ref, X.norm()) < 1e-12
    torch.testing.assert_close(An.mT @ An, torch.diag(S[:r]), rtol=0, atol=1e-12 * float(S[0]))
    torch.testing.assert_close(Bn.mT @ Bn, torch.diag(S[:r]), rtol=0, atol=1e-12 * float(S[0]))
    Ao, Bo = _stacked_qr_retract(A, B, dA, dB, lr)
    torch.testing.assert_close(An @ Bn.mT, Ao @ Bo.mT, rtol=0, atol=1e-12 * float(X.norm()))
    Af, Bf = retract(A, B, dA, dB, lr, frame(A, B, qr), qr)
    torch.testing.assert_close(Af, An, rtol=0, atol=0)
    torch.testing.assert_close(Bf, Bn, rtol=0, atol=0)


@pytest.mark.parametrize("factor_batch", [False, True], ids=["shared-factors", "batched-factors"])
def test_retract_batched_matches_loop(factor_batch):
    g = gen(180)
    m, n, r, b = 7, 9, 2, 4
    A, B = rand_factors(g, m, n, r, (b,))
    if not factor_batch:
        A, B = A[0].expand(b, m, r), B[0].expand(b, n, r)
    dA, dB = randn(g, b, m, r), randn(g, b, n, r)
    An, Bn = retract(A, B, dA, dB, 0.2)
    assert An.shape == (b, m, r) and Bn.shape == (b, n, r)
    for i in range(b):
        Ai, Bi = retract(A[i], B[i], dA[i], dB[i], 0.2)
        torch.testing.assert_close(An[i] @ Bn[i].mT, Ai @ Bi.mT, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(An[i].mT @ An[i], Ai.mT @ Ai, rtol=1e-12, atol=1e-12)
        ref, _ = truncated_svd(A[i] @ B[i].mT - 0.2 * dense_tangent(A[i], B[i], dA[i], dB[i]), r)
        assert rel_err(An[i] @ Bn[i].mT, ref) < 1e-12


# ----------------------------------------------------------------------------------------------------------
# procrustes_align / balance
# ----------------------------------------------------------------------------------------------------------


def _procrustes_objective(A, B, A_ref, B_ref):
    return float(fro_sq(A - A_ref) + fro_sq(B - B_ref))


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_procrustes_align_is_optimal_rotation(m, n, r):
    g = gen(190 + m + 13 * n + 100 * r)
    A_new, B_new = balance(*rand_factors(g, m, n, r))
    A_ref, B_ref = rand_factors(g, m, n, r)
    Aa, Ba = procrustes_align(A_new, B_new, A_ref, B_ref)
    # output = (A_new Q, B_new Q) for one orthogonal Q
    stacked = torch.cat([A_new, B_new], dim=0)
    Q = torch.linalg.lstsq(stacked, torch.cat([Aa, Ba], dim=0)).solution
    torch.testing.assert_close(Q.mT @ Q, torch.eye(r, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(Aa, A_new @ Q, rtol=0, atol=1e-12)
    torch.testing.assert_close(Ba, B_new @ Q, rtol=0, atol=1e-12)
    # Z and the balance are unchanged
    assert rel_err(Aa @ Ba.mT, A_new @ B_new.mT) < 1e-13
    torch.testing.assert_close(Aa.mT @ Aa, Ba.mT @ Ba, rtol=0, atol=1e-12 * float(fro_sq(A_new)))
    # optimal: no random rotation and no small rotation of the result does better
    best = _procrustes_objective(Aa, Ba, A_ref, B_ref)
    assert best <= _procrustes_objective(A_new, B_new, A_ref, B_ref) + 1e-12
    for _ in range(20):
        O = rand_orth(g, r, r)
        assert best <= _procrustes_objective(A_new @ O, B_new @ O, A_ref, B_ref) + 1e-10
        K = randn(g, r, r)
        O_small = torch.linalg.matrix_exp(1e-3 * (K - K.mT))
        assert best <= _procrustes_objective(Aa @ O_small, Ba @ O_small, A_ref, B_ref) + 1e-12


@pytest.mark.parametrize("r", [1, 2, 3])
def test_procrustes_recovers_known_rotation(r):
    g = gen(200 + r)
    A, B = rand_factors(g, 8, 6, r)
    R = rand_orth(g, r, r)
    if r > 1:
        R[:, 0] = -R[:, 0]  # include a reflection (det -1): O(r), not only SO(r)
    Aa, Ba = procrustes_align(A @ R, B @ R, A, B)
    torch.testing.assert_close(Aa, A, rtol=0, atol=1e-12)
    torch.testing.assert_close(Ba, B, rtol=0, atol=1e-12)


def test_procrustes_batched_matches_loop():
    g = gen(205)
    A, B = rand_factors(g, 7, 5, 3, (3,))
    Ar, Br = rand_factors(g, 7, 5, 3, (3,))
    Aa, Ba = procrustes_align(A, B, Ar, Br)
    for i in range(3):
        Ai, Bi = procrustes_align(A[i], B[i], Ar[i], Br[i])
        torch.testing.assert_close(Aa[i], Ai, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(Ba[i], Bi, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_balance_same_point_balanced(m, n, r):
    g = gen(210 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    R, _ = rand_gl(g, r, 30.0)
    A = A @ R  # make it clearly unbalanced
    assert float((A.mT @ A - B.mT @ B).norm()) > 0.1
    Ab, Bb = balance(A, B)
    assert rel_err(Ab @ Bb.mT, A @ B.mT) < 1e-12
    _, S = truncated_svd(A @ B.mT, r)
    torch.testing.assert_close(Ab.mT @ Ab, Bb.mT @ Bb, rtol=0, atol=1e-12 * float(S[0]))
    torch.testing.assert_close(Ab.mT @ Ab, torch.diag(S[:r]), rtol=0, atol=1e-12 * float(S[0]))
    # batched == loop
    Ab2, Bb2 = balance(torch.stack([A, 2 * A]), torch.stack([B, B]))
    for i, s in enumerate((1.0, 2.0)):
        ref_A, ref_B = balance(s * A, B)
        torch.testing.assert_close(Ab2[i], ref_A, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(Bb2[i], ref_B, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# GL(r) gauge invariance (Thm. gauge_invariant)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_gauge_invariance_of_lift_norms_projection_and_retraction(m, n, r):
    g = gen(220 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    R, R_inv_t = rand_gl(g, r, 50.0)
    A2, B2 = A @ R, B @ R_inv_t
    assert rel_err(A2 @ B2.mT, A @ B.mT) < 1e-13
    G = randn(g, 3, m, n)
    dA, dB = canonical_lift(A, B, G @ B, G.mT @ A)
    dA2, dB2 = canonical_lift(A2, B2, G @ B2, G.mT @ A2)
    dZ, dZ2 = dense_tangent(A, B, dA, dB), dense_tangent(A2, B2, dA2, dB2)
    assert rel_err(dZ2, dZ, G.norm()) < 1e-11
    if r > 1:  # the lifts themselves are gauge dependent (so the check above is not vacuous)
        assert rel_err(dA2, dA) > 1e-3
    torch.testing.assert_close(tangent_project(A2, B2, G), tangent_project(A, B, G), rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(tangent_norm_sq(A2, B2, dA2, dB2), tangent_norm_sq(A, B, dA, dB), rtol=1e-10, atol=0)
    torch.testing.assert_close(
        projected_grad_norm_sq(frame(A2, B2), G @ B2, G.mT @ A2),
        projected_grad_norm_sq(frame(A, B), G @ B, G.mT @ A),
        rtol=1e-10,
        atol=0,
    )
    # the retracted point is intrinsic too
    An, Bn = retract(A, B, dA[0], dB[0], 0.3)
    An2, Bn2 = retract(A2, B2, dA2[0], dB2[0], 0.3)
    assert rel_err(An2 @ Bn2.mT, An @ Bn.mT) < 1e-10


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_gauge_noise_equal_in_law_exact(m, n, r):
    """Same Omega under the two gauges gives intrinsic noises related by an orthogonal change of Omega.

    With Q_A' = Q_A O_A, Q_B' = Q_B O_B (O orthogonal, as col(A') = col(A)), the intrinsic noise is
    (I - Pi_A) Omega_A Q_B^T + Q_A Omega_B^T, so N'(Omega_A, Omega_B) = N(Omega_A O_B^T, Omega_B O_A^T):
    equal in law because a standard Gaussian matrix is invariant under right multiplication by O.
    """
    g = gen(230 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    R, R_inv_t = rand_gl(g, r, 50.0)
    A2, B2 = A @ R, B @ R_inv_t
    fr, fr2 = frame(A, B), frame(A2, B2)
    O_A, O_B = fr.QA.mT @ fr2.QA, fr.QB.mT @ fr2.QB
    eye = torch.eye(r, dtype=F64)
    torch.testing.assert_close(O_A.mT @ O_A, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(O_B.mT @ O_B, eye, rtol=0, atol=1e-12)
    omega_A, omega_B = randn(g, 4, m, r), randn(g, 4, n, r)
    N2 = dense_tangent(A2, B2, *noise_with_frame(fr2, omega_A, omega_B))
    N1 = dense_tangent(A, B, *noise_with_frame(fr, omega_A @ O_B.mT, omega_B @ O_A.mT))
    assert rel_err(N2, N1) < 1e-11


def test_gauge_noise_covariance_same_under_both_gauges():
    m, n, r, draws = 6, 5, 2, 20000
    A, B = rand_factors(gen(240), m, n, r)
    R, R_inv_t = rand_gl(gen(241), r, 50.0)
    A2, B2 = A @ R, B @ R_inv_t
    E = tangent_basis(A, B)  # one basis: the tangent space is the same
    E2 = tangent_basis(A2, B2)
    torch.testing.assert_close(E2 @ E2.mT, E @ E.mT, rtol=0, atol=1e-10)
    tol = cov_identity_tol(draws)
    covs = []
    for (X, Y), seed in (((A, B), 242), ((A2, B2), 243)):
        N = dense_tangent(X, Y, *draw_noise(X, Y, draws, seed))
        coords = N.reshape(draws, -1) @ E
        covs.append(coords.mT @ coords / draws)
        assert _covariance_deviation(N, E) < tol
    # two independent estimates of the same covariance: difference has sd <= sqrt(2) * sqrt(2/draws)
    assert float((covs[0] - covs[1]).abs().max()) < math.sqrt(2) * tol


# ----------------------------------------------------------------------------------------------------------
# ill-conditioned factors (float64, condition number 1e6)
# ----------------------------------------------------------------------------------------------------------

ILL_CASES = [(9, 7, 2, "independent"), (9, 7, 3, "independent"), (6, 11, 3, "gauge"), (10, 8, 2, "gauge")]
ILL_IDS = [f"m{m}-n{n}-r{r}-{k}" for m, n, r, k in ILL_CASES]


@pytest.mark.parametrize(("m", "n", "r", "kind"), ILL_CASES, ids=ILL_IDS)
def test_ill_conditioned_lift_and_norms(m, n, r, kind):
    g = gen(250 + m + 13 * n + 100 * r)
    A, B, UA, UB = ill_factors(g, m, n, r, kind)
    assert float(torch.linalg.cond(A)) > 1e5 and float(torch.linalg.cond(B)) > 1e5
    G = randn(g, 4, m, n)
    ref = dense_project(UA @ UA.mT, UB @ UB.mT, G)  # exact orthonormal bases, no Gram inverse
    gA, gB = G @ B, G.mT @ A
    dA, dB = canonical_lift(A, B, gA, gB)
    assert torch.isfinite(dA).all() and torch.isfinite(dB).all()
    for i in range(4):
        assert rel_err(dense_tangent(A, B, dA[i], dB[i]), ref[i], G[i].norm()) < 1e-6
        assert rel_err(tangent_project(A, B, G[i]), ref[i], G[i].norm()) < 1e-6
    ref_sq = fro_sq(ref)
    # intrinsic norms: accurate to ~cond * eps, not cond^2 * eps (clipping relies on them)
    torch.testing.assert_close(projected_grad_norm_sq(frame(A, B), gA, gB), ref_sq, rtol=1e-8, atol=0)
    torch.testing.assert_close(tangent_norm_sq(A, B, dA, dB), ref_sq, rtol=1e-8, atol=0)
    # the Gram form at the balanced factors of the same Z (cond(Z) ~ 1e10 here): as accurate
    Ab, Bb = balance(A, B)
    out = projected_grad_norm_sq_balanced(frame(Ab, Bb), G @ Bb, G.mT @ Ab)
    torch.testing.assert_close(out, ref_sq, rtol=1e-8, atol=0)
    # arbitrary lift: tangent_norm_sq against the dense norm of the same lift
    xA, xB = randn(g, m, r), randn(g, n, r)
    torch.testing.assert_close(tangent_norm_sq(A, B, xA, xB), fro_sq(dense_tangent(A, B, xA, xB)), rtol=1e-8, atol=0)


@pytest.mark.parametrize(("m", "n", "r", "kind"), ILL_CASES, ids=ILL_IDS)
def test_ill_conditioned_noise(m, n, r, kind):
    draws = 3000
    A, B, UA, UB = ill_factors(gen(260 + m + 13 * n + 100 * r), m, n, r, kind)
    XiA, XiB = draw_noise(A, B, draws, seed=261)
    assert torch.isfinite(XiA).all() and torch.isfinite(XiB).all()
    N = dense_tangent(A, B, XiA, XiB)
    PN = dense_project(UA @ UA.mT, UB @ UB.mT, N)
    assert rel_err(N, PN) < 1e-8
    energy = fro_sq(N)
    d = r * (m + n - r)
    se = float(energy.std()) / math.sqrt(draws)
    assert abs(float(energy.mean()) - d) < 5 * se
    assert se < 1.25 * math.sqrt(2 * d / draws)  # no heavy tail / blow-up from the conditioning


@pytest.mark.parametrize(("m", "n", "r", "kind"), ILL_CASES, ids=ILL_IDS)
@pytest.mark.parametrize("lr", [1e-3, 0.1])
def test_ill_conditioned_retraction(m, n, r, kind, lr):
    g = gen(270 + m + 13 * n + 100 * r)
    A, B, _, _ = ill_factors(g, m, n, r, kind)
    G = randn(g, m, n)
    dA, dB = canonical_lift(A, B, G @ B, G.mT @ A)
    X = A @ B.mT - lr * dense_tangent(A, B, dA, dB)
    ref, S = truncated_svd(X, r)
    assert float(S[r - 1] - S[r]) > 1e-4 * float(S[0])  # the truncation is well defined
    An, Bn = retract(A, B, dA, dB, lr)
    assert torch.isfinite(An).all() and torch.isfinite(Bn).all()
    assert rel_err(An @ Bn.mT, ref, X.norm()) < 1e-8
    torch.testing.assert_close(An.mT @ An, torch.diag(S[:r]), rtol=0, atol=1e-8 * float(S[0]))
    torch.testing.assert_close(Bn.mT @ Bn, torch.diag(S[:r]), rtol=0, atol=1e-8 * float(S[0]))


def test_ill_conditioned_balance_and_procrustes():
    g = gen(280)
    A, B, _, _ = ill_factors(g, 9, 7, 3, "gauge")
    Ab, Bb = balance(A, B)
    Z = A @ B.mT
    assert rel_err(Ab @ Bb.mT, Z) < 1e-9
    torch.testing.assert_close(Ab.mT @ Ab, Bb.mT @ Bb, rtol=0, atol=1e-9 * float(Z.norm()))
    O = rand_orth(g, 3, 3)
    Aa, Ba = procrustes_align(Ab @ O, Bb @ O, Ab, Bb)
    torch.testing.assert_close(Aa, Ab, rtol=0, atol=1e-9)
    torch.testing.assert_close(Ba, Bb, rtol=0, atol=1e-9)


# ----------------------------------------------------------------------------------------------------------
# float32
# ----------------------------------------------------------------------------------------------------------

TOL32 = 2e-5  # ~ 100 eps_32 relative, at condition numbers ~10


@pytest.mark.parametrize(("m", "n", "r"), SIZES, ids=SIZE_IDS)
def test_float32_close_to_float64(m, n, r):
    g = gen(290 + m + 13 * n + 100 * r)
    A, B = rand_factors(g, m, n, r)
    G = randn(g, 3, m, n)
    xA, xB = randn(g, 3, m, r), randn(g, 3, n, r)
    oA, oB = randn(g, m, r), randn(g, n, r)
    f = lambda t: t.to(F32)  # noqa: E731

    # frame
    fr64, fr32 = frame(A, B), frame(f(A), f(B))
    assert all(t.dtype == F32 for t in fr32)
    for t32, t64 in zip(fr32, fr64):
        assert rel_err(t32, t64) < TOL32
    # tangent_project
    P64, P32 = tangent_project(A, B, G), tangent_project(f(A), f(B), f(G))
    assert P32.dtype == F32 and rel_err(P32, P64, G.norm()) < TOL32
    # canonical_lift / lift_with_frame
    d64 = canonical_lift(A, B, G @ B, G.mT @ A)
    d32 = canonical_lift(f(A), f(B), f(G @ B), f(G.mT @ A))
    d32f = lift_with_frame(fr32, f(G @ B), f(G.mT @ A))
    for a, b_, c in zip(d32, d64, d32f):
        assert a.dtype == F32 and rel_err(a, b_) < TOL32 and rel_err(c, b_) < TOL32
    # tangent_norm_sq (arbitrary and canonical lifts), projected_grad_norm_sq
    torch.testing.assert_close(tangent_norm_sq(f(A), f(B), f(xA), f(xB)).double(),
                               tangent_norm_sq(A, B, xA, xB), rtol=TOL32, atol=0)
    torch.testing.assert_close(tangent_norm_sq(f(A), f(B), *d32).double(),
                               tangent_norm_sq(A, B, *d64), rtol=TOL32, atol=0)
    torch.testing.assert_close(projected_grad_norm_sq(fr32, f(G @ B), f(G.mT @ A)).double(),
                               fro_sq(P64), rtol=TOL32, atol=0)
    # noise_with_frame (same Omega), sample_tangent_noise (dtype, tangency)
    n64, n32 = noise_with_frame(fr64, oA, oB), noise_with_frame(fr32, f(oA), f(oB))
    for a, b_ in zip(n32, n64):
        assert a.dtype == F32 and rel_err(a, b_) < TOL32
    sA, sB = sample_tangent_noise(f(A), f(B), generator=gen(3))
    assert sA.dtype == F32 and sB.dtype == F32
    N = dense_tangent(A, B, sA.double(), sB.double())
    assert rel_err(N, dense_project(pinv_projector(A), pinv_projector(B), N)) < TOL32
    # retract
    dA, dB = d64[0][0], d64[1][0]
    R64 = retract(A, B, dA, dB, 0.1)
    R32 = retract(f(A), f(B), f(dA), f(dB), 0.1)
    assert R32[0].dtype == F32
    assert rel_err(R32[0] @ R32[1].mT, R64[0] @ R64[1].mT) < TOL32
    assert rel_err(R32[0].mT @ R32[0], R64[0].mT @ R64[0]) < TOL32
    # balance, procrustes_align (compare after aligning, which removes the sign ambiguity)
    Ab64, Bb64 = balance(A, B)
    Ab32, Bb32 = balance(f(A), f(B))
    Aa32, Ba32 = procrustes_align(Ab32, Bb32, f(Ab64), f(Bb64))
    assert Aa32.dtype == F32
    assert rel_err(Aa32, Ab64) < TOL32 and rel_err(Ba32, Bb64) < TOL32
    Ar, Br = rand_factors(g, m, n, r)
    al64 = procrustes_align(Ab64, Bb64, Ar, Br)
    al32 = procrustes_align(f(Ab64), f(Bb64), f(Ar), f(Br))
    for a, b_ in zip(al32, al64):
        assert rel_err(a, b_) < TOL32
    # tangent_to_dense
    assert rel_err(tangent_to_dense(f(A), f(B), f(xA), f(xB)), dense_tangent(A, B, xA, xB)) < TOL32


@pytest.mark.parametrize("cond", [1e2, 1e3, 1e4])
def test_float32_gauge_ill_conditioned_norms(cond):
    """float32 factors of condition number ``cond`` in a pure gauge (Z itself benign).

    Backward-stable formulas through orthonormal bases give relative errors ~cond * eps_32 (measured: below
    0.5 cond eps_32 for the lift and projected_grad_norm_sq over several seeds, hence the bound 2 cond eps_32).
    A formula through the Gram matrices M = A^T A, N = B^T B loses ~cond^2 * eps_32 to cancellation
    (measured 3..17 cond eps_32 at cond 1e3 and ~150 cond eps_32, i.e. 2% relative, at cond 1e4).
    """
    g = gen(300)
    m, n, r = 12, 10, 3
    A, B, UA, UB = ill_factors(g, m, n, r, "gauge", cond=cond)
    G = randn(g, 4, m, n)
    ref = fro_sq(dense_project(UA @ UA.mT, UB @ UB.mT, G))
    f = lambda t: t.to(F32)  # noqa: E731
    tol = 2 * cond * torch.finfo(F32).eps
    A32, B32 = f(A), f(B)
    gA, gB = f(G @ B), f(G.mT @ A)
    dA, dB = canonical_lift(A32, B32, gA, gB)
    # the float32 lift reproduces the float64 projection
    for i in range(4):
        assert rel_err(dense_tangent(A, B, dA[i].double(), dB[i].double()), dense_project(UA @ UA.mT, UB @ UB.mT, G[i]), G[i].norm()) < tol
    torch.testing.assert_close(projected_grad_norm_sq(frame(A32, B32), gA, gB).double(), ref, rtol=tol, atol=0)
    torch.testing.assert_close(tangent_norm_sq(A32, B32, dA, dB).double(), ref, rtol=tol, atol=0)


def test_retract_takes_a_python_learning_rate_as_a_scalar_not_a_tensor_per_call():
    """A float ``lr`` enters the retraction as a scalar operand (no ``torch.as_tensor`` per call: on a GPU a tensor
    made on the host and copied to the device every step), with the same result bit for bit as a tensor ``lr``."""
    from torch.overrides import TorchFunctionMode

    from prismdp.geometry import retract

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    A, B, dA, dB = (torch.randn(2, n, 3, generator=g) for n in (7, 5, 7, 5))
    with Calls() as calls:
        got = retract(A, B, dA, dB, 0.01)
    assert "as_tensor" not in calls.names and "tensor" not in calls.names
    want = retract(A, B, dA, dB, torch.tensor(0.01))
    assert all(torch.equal(x, y) for x, y in zip(got, want))
