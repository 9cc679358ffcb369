"""PRISM's rank-space adaptive step and its variants (floor modes, debiasing, horizontal lift, presets) against hand
computations and dense references in float64, and its O(r) gauge equivariance."""

import math

import pytest
import torch

from prismdp import geometry
from prismdp.optim.adaptive import (FLOOR_MODES, LIFTS, PRESETS, AdaptiveOptions, adaptive_direction, floors,
                                    noise_covariances, precondition)

f64 = torch.float64


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def balanced(m=9, n=7, r=3, seed=0, spread=10.0):
    """Balanced factors (A^T A = B^T B) with singular values spread over ``spread``."""
    U, _ = torch.linalg.qr(rand(m, r, seed=seed))
    V, _ = torch.linalg.qr(rand(n, r, seed=seed + 1))
    s = torch.logspace(0, math.log10(spread), r, dtype=f64)
    return U * s.sqrt(), V * s.sqrt()


def test_presets_are_the_papers_formula_and_the_authors_training_defaults():
    assert PRESETS["paper"] == AdaptiveOptions("paper", 1.0, True, "none", 1e4)
    assert PRESETS["reference"] == AdaptiveOptions("scalar", 0.5, False, "both", 1e4)
    assert AdaptiveOptions.from_preset("reference", floor_factor=2.0).floor_factor == 2.0
    assert AdaptiveOptions.from_preset("reference", floor_factor=None).floor_factor == 0.5
    for bad in (dict(floor_mode="additive"), dict(horizontal_lift="yes"), dict(floor_factor=-1), dict(cond_max=0.5)):
        with pytest.raises(ValueError):
            AdaptiveOptions(**bad)
    with pytest.raises(ValueError, match="preset"):
        AdaptiveOptions.from_preset("authors")


def test_each_floor_mode_on_a_hand_computed_case():
    """m = 4, n = 3, r = 2, A^T A = B^T B = diag(4, 1/4) (so M^-1 = N^-1 = diag(1/4, 4)), tau = 0.1."""
    m, n, r, tau = 4, 3, 2, 0.1
    A = torch.zeros(m, r, dtype=f64)
    A[0, 0], A[1, 1] = 2.0, 0.5
    B = torch.zeros(n, r, dtype=f64)
    B[0, 0], B[2, 1] = 2.0, 0.5
    fr = geometry.frame(A, B)
    noise_A, noise_B = noise_covariances(fr, m, tau)
    inv = torch.diag(torch.tensor([0.25, 4.0], dtype=f64))
    torch.testing.assert_close(noise_A, tau**2 * (m - r) / m * inv)  # 0.01 * 0.5 * diag(1/4, 4)
    torch.testing.assert_close(noise_B, tau**2 * inv)
    mean_A, mean_B = 0.01 * 0.5 * 4.25 / 2, 0.01 * 4.25 / 2  # tr(.) / r
    expect = {"paper": (mean_A, mean_B), "geometry": (max(0.01, mean_A), max(0.01, mean_B)),
              "scalar": (0.01, 0.01), "none": (0.0, 0.0)}
    for mode in FLOOR_MODES:
        fa, fb = floors(AdaptiveOptions(floor_mode=mode, floor_factor=2.0), noise_A, noise_B, tau)
        assert float(fa) == pytest.approx(2 * expect[mode][0], rel=1e-12), mode
        assert float(fb) == pytest.approx(2 * expect[mode][1], rel=1e-12), mode
    assert floors(AdaptiveOptions(), noise_A, noise_B, 0.0) == (0.0, 0.0)  # no noise, no floor
    # the preconditioner: V = diag(1, 1e-4); additive floor f -> eig + f + eps, clamp floor f -> max(eig + eps, f)
    V, f, eps = torch.diag(torch.tensor([1.0, 1e-4], dtype=f64)), 0.02, 1e-8
    P, w = precondition(V, f, eps, math.inf, clamp=False)
    torch.testing.assert_close(w, torch.tensor([1e-4 + f + eps, 1.0 + f + eps], dtype=f64))
    torch.testing.assert_close(P, torch.diag(torch.tensor([1 / math.sqrt(1.0 + f + eps), 1 / math.sqrt(1e-4 + f + eps)],
                                                          dtype=f64)))
    P, w = precondition(V, f, eps, math.inf, clamp=True)
    torch.testing.assert_close(w, torch.tensor([f, 1.0 + eps], dtype=f64))
    P, w = precondition(V, 0.0, eps, 1e3, clamp=True)  # condition clamp: 1e-4 raised to max / 1e3
    torch.testing.assert_close(w, torch.tensor([(1.0 + eps) / 1e3, 1.0 + eps], dtype=f64))
    P, w = precondition(-V, 0.0, eps, math.inf)  # negative eigenvalues (after debiasing) are clipped at 0 first
    torch.testing.assert_close(w, torch.tensor([eps, eps], dtype=f64))


@pytest.mark.parametrize("mode", FLOOR_MODES[:-1])
def test_amplification_is_bounded_by_one_over_the_floor(mode):
    """Theorem precond_bound: ||X P||_F^2 <= ||X||_F^2 / lambda for every X, with P = the floored preconditioner."""
    A, B = balanced(m=40, n=30, r=4, spread=1e3)
    fr = geometry.frame(A, B)
    tau = 0.3
    noise_A, noise_B = noise_covariances(fr, 40, tau)
    opts = AdaptiveOptions(floor_mode=mode)
    for V, lam in zip((noise_A * 1e-3, noise_B * 1e-6), floors(opts, noise_A, noise_B, tau)):  # V far below the floor
        P, _ = precondition(V, lam, 1e-8, math.inf, clamp=mode != "paper")
        for seed in range(5):
            X = rand(40, 4, seed=seed)
            assert float((X @ P).square().sum()) <= float(X.square().sum()) / float(lam) * (1 + 1e-12)
        # and the bound is attained along the floored eigenvector (it is the right bound, not a loose one)
        assert float(torch.linalg.matrix_norm(P, 2)) == pytest.approx(1 / math.sqrt(float(lam)), rel=1e-3)


@pytest.mark.parametrize("m,n,r", [(9, 7, 3), (30, 12, 4)])
def test_horizontal_lift_keeps_dZ_and_is_horizontal(m, n, r):
    for A, B in (balanced(m, n, r), (rand(m, r, seed=3) * 5, rand(n, r, seed=4) * 0.1)):  # balanced and not
        dA, dB = rand(m, r, seed=5), rand(n, r, seed=6)
        hA, hB = geometry.horizontal_lift(A, B, dA, dB)
        torch.testing.assert_close(geometry.tangent_to_dense(A, B, hA, hB), geometry.tangent_to_dense(A, B, dA, dB),
                                   rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(A.T @ hA, hB.T @ B, rtol=1e-9, atol=1e-10)
        assert not torch.allclose(A.T @ dA, dB.T @ B)  # the canonical / a random lift is not horizontal
        # minimum norm among the lifts of the same dZ (Prop. min_norm_lift): (dA + A W, dB - B W^T) for any W
        for seed in range(5):
            W = rand(r, r, seed=10 + seed)
            other = (hA + A @ W).square().sum() + (hB - B @ W.T).square().sum()
            assert float(hA.square().sum() + hB.square().sum()) <= float(other)
        # batched = one by one
        bA, bB = geometry.horizontal_lift(torch.stack([A, 2 * A]), torch.stack([B, B / 2]), torch.stack([dA, dA]),
                                          torch.stack([dB, dB]))
        torch.testing.assert_close(bA[0], hA)
        torch.testing.assert_close(bB[1], geometry.horizontal_lift(2 * A, B / 2, dA, dB)[1])


def _post_process(opts, A, B, dA, dB, state, tau, lr=0.05, diagonal=False):
    """PRISM's post-processing of one release: lift -> adaptive direction -> lift -> retraction."""
    fr = geometry.frame(A, B)
    if opts.lift_before("moments"):
        dA, dB = geometry.horizontal_lift(A, B, dA, dB, fr)
    if diagonal:  # a negative control: Adam's coordinate-wise preconditioner is not O(r)-equivariant
        for k, g in (("a", dA), ("b", dB)):
            state[k] = 0.9 * state.get(k, torch.zeros_like(g)) + 0.1 * g.square()
        dA, dB = dA / (state["a"].sqrt() + 1e-8), dB / (state["b"].sqrt() + 1e-8)
    else:
        dA, dB, _ = adaptive_direction(state, fr, dA, dB, tau, (0.9, 0.999), 1e-8, opts)
    if opts.lift_before("retraction"):
        dA, dB = geometry.horizontal_lift(A, B, dA, dB, fr)
    return geometry.procrustes_align(*geometry.retract(A, B, dA, dB, lr), A, B)


@pytest.mark.parametrize("variant", [*[dict(floor_mode=f) for f in FLOOR_MODES], dict(debias=False),
                                     *[dict(horizontal_lift=h) for h in LIFTS[1:]], dict(cond_max=math.inf),
                                     "reference"])
def test_every_variant_is_equivariant_under_orthogonal_gauges(variant):
    """From (A, B) and (A Q, B Q) (Q orthogonal: the gauge balanced factors leave), releases that are the same
    tangent vectors give the same Z at every step, with the floors and debiasing active (tau > 0)."""
    opts = AdaptiveOptions.from_preset("reference") if variant == "reference" else AdaptiveOptions(**variant)
    m, n, r, tau = 12, 9, 3, 0.2
    A, B = balanced(m, n, r, spread=30.0)
    Q, _ = torch.linalg.qr(rand(r, r, seed=7))
    A2, B2 = A @ Q, B @ Q
    st1, st2 = {}, {}
    for t in range(6):
        G = rand(m, n, seed=100 + t)  # a dense "gradient": both lifts are lifts of its projection at each point
        lifts = [geometry.canonical_lift(a, b, G @ b, G.T @ a) for a, b in ((A, B), (A2, B2))]
        A, B = _post_process(opts, A, B, *lifts[0], st1, tau)
        A2, B2 = _post_process(opts, A2, B2, *lifts[1], st2, tau)
        torch.testing.assert_close(A2 @ B2.T, A @ B.T, rtol=1e-9, atol=1e-11)
    assert float((A @ B.T - balanced(m, n, r, spread=30.0)[0] @ balanced(m, n, r, spread=30.0)[1].T).norm()) > 1e-2


def test_the_equivariance_test_has_power():
    """Coordinate-wise (Adam-style) preconditioning in the same loop breaks the equality."""
    m, n, r = 12, 9, 3
    A, B = balanced(m, n, r, spread=30.0)
    Q, _ = torch.linalg.qr(rand(r, r, seed=7))
    A2, B2 = A @ Q, B @ Q
    st1, st2, opts = {}, {}, AdaptiveOptions()
    for t in range(3):
        G = rand(m, n, seed=100 + t)
        lifts = [geometry.canonical_lift(a, b, G @ b, G.T @ a) for a, b in ((A, B), (A2, B2))]
        A, B = _post_process(opts, A, B, *lifts[0], st1, 0.2, diagonal=True)
        A2, B2 = _post_process(opts, A2, B2, *lifts[1], st2, 0.2, diagonal=True)
    assert not torch.allclose(A2 @ B2.T, A @ B.T, rtol=1e-6, atol=1e-8)


def test_the_adaptive_direction_is_the_papers_formula_written_out_in_numpy():
    """Three steps of ``adaptive_direction`` (paper preset: debiased second moments, additive floor of the noise's
    mean eigenvalue, condition clamp) on a stack of two modules with m != n, against the formula in numpy float64:
    V_A <- b2 V_A + (1 - b2) dA^T dA / m, V_B likewise with n; bias-corrected; minus the noise's second moments
    tau^2 (m - r) / m (B^T B)^-1 and tau^2 (A^T A)^-1; P = (max(V, 0) + floor + eps)^-1/2 through numpy's own
    eigendecomposition; U_A = m_A / (1 - b1^t) P_A, U_B = m_B / (1 - b1^t) P_B (each side its own P)."""
    import numpy as np

    k, m, n, r, tau, eps, (b1, b2) = 2, 10, 6, 3, 0.3, 1e-8, (0.9, 0.99)
    pairs = [balanced(m, n, r, seed=s, spread=20.0) for s in (0, 5)]
    A, B = torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])
    fr, opts, state = geometry.frame(A, B), AdaptiveOptions(), {}
    An, Bn = A.numpy(), B.numpy()
    noise_A = tau**2 * (m - r) / m * np.linalg.inv(np.swapaxes(Bn, 1, 2) @ Bn)
    noise_B = tau**2 * np.linalg.inv(np.swapaxes(An, 1, 2) @ An)
    ref = {"mA": 0.0, "mB": 0.0, "VA": 0.0, "VB": 0.0}

    def inv_sqrt(V, floor):
        w, Q = np.linalg.eigh(0.5 * (V + np.swapaxes(V, 1, 2)))
        w = np.clip(w, 0.0, None) + floor[:, None] + eps
        w = np.maximum(w, w.max(axis=1, keepdims=True) / opts.cond_max)
        return (Q / np.sqrt(w)[:, None, :]) @ np.swapaxes(Q, 1, 2)

    for t in range(1, 4):
        dA, dB = rand(k, m, r, seed=10 * t), rand(k, n, r, seed=10 * t + 1) * 3.0  # the two sides differ in scale
        UA, UB, _ = adaptive_direction(state, fr, dA, dB, tau, (b1, b2), eps, opts)
        a, b = dA.numpy(), dB.numpy()
        ref["mA"] = b1 * ref["mA"] + (1 - b1) * a
        ref["mB"] = b1 * ref["mB"] + (1 - b1) * b
        ref["VA"] = b2 * ref["VA"] + (1 - b2) * np.swapaxes(a, 1, 2) @ a / m
        ref["VB"] = b2 * ref["VB"] + (1 - b2) * np.swapaxes(b, 1, 2) @ b / n
        VA = ref["VA"] / (1 - b2**t) - noise_A
        VB = ref["VB"] / (1 - b2**t) - noise_B
        floor_A = np.trace(noise_A, axis1=1, axis2=2) / r
        floor_B = np.trace(noise_B, axis1=1, axis2=2) / r
        want_A = ref["mA"] / (1 - b1**t) @ inv_sqrt(VA, floor_A)
        want_B = ref["mB"] / (1 - b1**t) @ inv_sqrt(VB, floor_B)
        np.testing.assert_allclose(UA.numpy(), want_A, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(UB.numpy(), want_B, rtol=1e-9, atol=1e-12)
