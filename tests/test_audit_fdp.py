"""prismdp.audit.fdp (the f-DP one-run audit of Mahloujifar, Melis and Chaudhuri 2024) against hand-worked cases,
independently computed values, exact binomial tails and simulated Gaussian-DP mechanisms.

Independent values: jax-privacy 2.0.0 from PyPI (``CanaryScoreAuditor.epsilon_one_run_fdp`` and
``_epsilon_one_run_fdp``, which search over epsilon with dp-accounting's ``get_sigma_gaussian``; this module searches
over mu), in a throwaway venv, not a dependency of prismdp:
    python3 -m venv /tmp/jaxp && /tmp/jaxp/bin/pip install --no-deps jax-privacy==2.0.0 && \
      /tmp/jaxp/bin/pip install numpy scipy dp-accounting
    # jax_privacy/auditing.py imports only numpy, scipy and dp_accounting: load that file by path, then
    rng = np.random.default_rng(SEED); ins = np.round(rng.normal(SHIFT, 1, N_IN), DEC)
    outs = np.round(rng.normal(0, 1, N_OUT), DEC)
    print(auditing.CanaryScoreAuditor(ins, outs).epsilon_one_run_fdp(0.05, DELTA))
    print(auditing._epsilon_one_run_fdp(0.0, M, N_GUESS, N_CORRECT, 0.05, DELTA))
"""

import json

import numpy as np
import pytest
import scipy.stats

from prismdp.audit import audit_one_run
from prismdp.audit.statistics import candidate_thresholds
from prismdp.audit.fdp import (audit_one_run_fdp, audit_one_run_mechanism, fdp_gap, gdp_blow_up_inverse, gdp_delta,
                               gdp_epsilon, mu_one_run, profile_blow_up_inverse, subsampled_gaussian_blow_up_inverse)

Phi, Phi_inv = scipy.stats.norm.cdf, scipy.stats.norm.ppf


def test_recursion_hand_worked_no_privacy_loss():
    # fbar^-1 = identity, m = 10, 2 of 2 guesses right, tau = a:  r_2 = 2a/10, h_2 = 0;
    # i = 1: h_1 = max(0, r_2) = 0.2a, r_1 = r_2 + 1/(2-1) (h_1 - h_2) = 0.4a;
    # i = 0: h_0 = max(h_1, r_1) = 0.4a, r_0 = r_1 + 0 = 0.4a;  gap = r_0 + h_0 - 2/10 = 0.8a - 0.2
    for a in (0.05, 0.2, 0.3):
        assert fdp_gap(lambda y: y, 10, 2, 2, a) == pytest.approx(0.8 * a - 0.2, abs=1e-15)


def test_recursion_hand_worked_gaussian():
    # mu = 0.1, m = 10, 2 of 3 right, tau = 0.05: both branches of each max are exercised
    mu, a, m = 0.1, 0.05, 10
    r, h = 2 * a / m, 1 * a / m
    h1 = max(h, Phi(Phi_inv(r) - mu))
    r1 = r + 1 / (3 - 1) * (h1 - h)
    h0 = max(h1, Phi(Phi_inv(r1) - mu))
    r0 = r1 + 0 / (3 - 0) * (h0 - h1)
    assert h1 > h and h0 > h1  # the f-DP branch is the active one at both steps
    assert fdp_gap(gdp_blow_up_inverse(mu), m, 3, 2, a) == pytest.approx(r0 + h0 - 3 / m, rel=1e-12)


@pytest.mark.parametrize("k", [10, 50, 200])
def test_no_privacy_loss_test_is_the_binomial_test(k):
    # with fbar^-1 = identity (0-GDP: the guesses are coin flips) the smallest rejected count c has
    # P[Binomial(k, 1/2) >= c] <= 5 %, and one fewer correct guess would not be (the test is tight there)
    crit = next(c for c in range(k + 1) if fdp_gap(lambda y: y, 1000, k, c, 0.05) > 0)
    assert scipy.stats.binom.sf(crit - 1, k, 0.5) <= 0.05 < scipy.stats.binom.sf(crit - 2, k, 0.5)


# (seed, n_in, n_out, shift, decimals, delta) -> jax-privacy 2.0.0's epsilon_one_run_fdp(0.05, delta)
JAX_PRIVACY_SCORES = [
    ((0, 50, 50, 1.5, 6, 1e-05), 1.5219389958426173),
    ((1, 100, 100, 2.0, 1, 1e-05), 2.4822981261849515),
    ((2, 37, 63, 3.0, 6, 1e-05), 2.9666479902945158),
    ((3, 500, 500, 1.0, 6, 1e-05), 1.6599550478305876),
    ((3, 500, 500, 1.0, 6, 3e-4), 1.2729799730558118),
    ((4, 200, 300, 2.5, 2, 1e-05), 3.7548347755973293),
    ((5, 1000, 1000, 0.0, 6, 1e-05), 0.0),
    ((6, 480, 520, 0.8, 6, 1e-05), 1.6658211389724011),
]


@pytest.mark.parametrize("case,expected", JAX_PRIVACY_SCORES)
def test_audit_matches_jax_privacy(case, expected):
    seed, n_in, n_out, shift, decimals, delta = case
    rng = np.random.default_rng(seed)
    ins, outs = np.round(rng.normal(shift, 1, n_in), decimals), np.round(rng.normal(0, 1, n_out), decimals)
    got = audit_one_run_fdp(ins, outs, delta=delta, threshold_rule="hull").eps_lower_bound
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("args,expected", [
    ((100, 50, 45, 1e-05), 2.7930206042037895),
    ((1000, 100, 90, 1e-06), 2.768682797123585),
    ((1000, 100, 60, 1e-03), 0.017216641180575573),
    ((10, 10, 10, 0.1), 0.5577350902555487),
    ((1000, 500, 400, 1e-05), 2.076806928840693),
    ((200, 20, 20, 1e-05), 2.892102871817154),
])
def test_counts_match_jax_privacy(args, expected):
    m, n_guess, n_correct, delta = args
    assert gdp_epsilon(mu_one_run(m, n_guess, n_correct, 0.05), delta) == pytest.approx(expected, rel=1e-5)


def test_gdp_epsilon_inverts_the_published_delta():
    # Dong, Roth, Su 2019, Cor. 2.13 evaluated with scipy here, and the round trip
    mu, eps = 1.0, 2.0
    direct = Phi(-eps / mu + mu / 2) - np.exp(eps) * Phi(-eps / mu - mu / 2)
    assert gdp_delta(mu, eps) == pytest.approx(direct, rel=1e-10)
    assert gdp_epsilon(mu, direct) == pytest.approx(eps, rel=1e-8)
    assert gdp_epsilon(0.0, 1e-5) == 0.0


def test_more_correct_guesses_give_a_higher_bound():
    bounds = [mu_one_run(1000, 100, c, 0.05) for c in range(55, 101, 5)]
    assert bounds[0] == 0.0 and all(b < b2 for b, b2 in zip(bounds[1:], bounds[2:]))
    assert mu_one_run(1000, 100, 90, 0.01) < mu_one_run(1000, 100, 90, 0.05)  # more confidence, lower bound


def test_all_guesses_right_beat_the_eps_delta_bound():
    # 1000 canaries with perfectly separated scores: (eps, delta) proves at most 4.44 at delta 1e-5 (its ceiling,
    # docs/privacy-audit.md: 500 right of 500 at significance 0.05 / 10, the ladder's length; 4.75 at 0.05 / 3, the
    # hull's 3 vertices); the f-DP test on the same guesses proves far more
    bits = np.arange(1000) % 2 == 0
    scores = bits.astype(float)
    fdp = audit_one_run_fdp(scores[bits], scores[~bits], delta=1e-5)
    eps_delta = audit_one_run(scores[bits], scores[~bits], delta=1e-5).eps_lower_bound
    assert eps_delta == pytest.approx(4.44, abs=0.01)
    assert audit_one_run(scores[bits], scores[~bits], delta=1e-5, threshold_rule="hull").eps_lower_bound == \
        pytest.approx(4.75, abs=0.01)
    assert fdp.correct == fdp.guesses == 500 and fdp.eps_lower_bound > eps_delta + 2.5  # 7.37


def test_random_guessing_gives_about_nothing():
    rng = np.random.default_rng(3)
    mus = []
    for _ in range(40):
        bits, scores = rng.random(1000) < 0.5, rng.normal(size=1000)
        mus.append(audit_one_run_fdp(scores[bits], scores[~bits], delta=1e-5).mu_lower_bound)
    assert np.median(mus) == 0.0 and max(mus) < 0.3 and np.mean(np.array(mus) > 0) <= 0.15


def _gdp_scores(rng, mu, m):
    bits = rng.random(m) < 0.5
    return bits, mu * bits + rng.normal(size=m)  # each canary's score: N(0, 1) out, N(mu, 1) in: exactly mu-GDP


def test_false_alarms_on_an_exactly_gaussian_dp_mechanism():
    # the claim "mu-GDP" is true; it may be rejected in at most 5 % of runs (binomial slack: 3 sd)
    rng = np.random.default_rng(11)
    mu, m, runs = 1.0, 1000, 300
    inv = gdp_blow_up_inverse(mu)
    for k in (20, 100):  # a fixed number of guesses (top-k scores), no threshold choice
        alarms = 0
        for _ in range(runs):
            bits, scores = _gdp_scores(rng, mu, m)
            alarms += fdp_gap(inv, m, k, int(bits[np.argsort(-scores)[:k]].sum()), 0.05) > 0
        assert alarms / runs <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / runs)
    above = 0
    for _ in range(60):  # the whole audit, the threshold chosen after the coins: its bound rarely exceeds mu
        bits, scores = _gdp_scores(rng, mu, m)
        above += audit_one_run_fdp(scores[bits], scores[~bits], delta=1e-5).mu_lower_bound > mu
    assert above <= 6


def test_profile_curve_is_a_conservative_copy_of_the_gaussian():
    # mu-GDP's own delta(eps) profile (Cor. 2.13) on a grid: its fbar^-1 lies at or below the closed form, close
    mu, grid = 1.0, np.linspace(-2, 10, 1201)
    approx = profile_blow_up_inverse(grid, [gdp_delta(mu, e) if e >= 0 else 1 - np.exp(e) + np.exp(e) *
                                            gdp_delta(mu, -e) for e in grid])
    exact = gdp_blow_up_inverse(mu)
    for y in (1e-4, 1e-3, 0.01, 0.1, 0.5, 0.9):
        assert approx(y) <= exact(y) + 1e-12 and approx(y) == pytest.approx(exact(y), rel=2e-3, abs=1e-9)


@pytest.mark.parametrize("steps", [1, 4])
def test_unsampled_gaussian_steps_are_gaussian_dp(steps):
    # q = 1: the Gaussian mechanism with noise multiplier sigma is exactly (1/sigma)-GDP, T of them sqrt(T)/sigma
    sigma = 0.8 * np.sqrt(steps)
    pld, exact = subsampled_gaussian_blow_up_inverse(sigma, 1.0, steps), gdp_blow_up_inverse(np.sqrt(steps) / sigma)
    for y in (1e-4, 1e-3, 0.01, 0.1, 0.5, 0.9):
        assert pld(y) <= exact(y) + 1e-12 and pld(y) == pytest.approx(exact(y), rel=2e-3, abs=1e-9)


def test_mechanism_family_bound_agrees_with_the_gaussian_bound():
    # the family "q = 1, one step, noise s" is (1/s)-GDP, so its bound must be 1 / (the mu bound), up to the PLD grid
    rng = np.random.default_rng(5)
    bits, scores = _gdp_scores(rng, 1.5, 1000)
    mu = audit_one_run_fdp(scores[bits], scores[~bits], delta=1e-5).mu_lower_bound
    mech = audit_one_run_mechanism(scores[bits], scores[~bits], sample_rate=1.0, steps=1, delta=1e-5)
    assert mu > 0.5 and 1 / mech.sigma_upper_bound == pytest.approx(mu, rel=5e-3)
    assert 1 / mech.sigma_upper_bound <= mu * (1 + 1e-6)  # the PLD curve is the weaker claim: never a higher bound


@pytest.mark.parametrize("kwargs,match", [
    (dict(in_scores=[], out_scores=[1.0], delta=1e-5), "non-empty"),
    (dict(in_scores=[1.0], out_scores=[np.inf], delta=1e-5), "finite"),
    (dict(in_scores=[1.0], out_scores=[0.0], delta=0.0), "delta"),
    (dict(in_scores=[1.0], out_scores=[0.0], delta=1e-5, significance=0.0), "significance"),
])
def test_audit_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        audit_one_run_fdp(**kwargs)
    with pytest.raises(ValueError, match="n_correct <= n_guess"):
        fdp_gap(lambda y: y, 10, 2, 3, 0.05)


def _audit_args(model_dir, out):
    return ["audit", "--model", model_dir, "--output", str(out), "--quiet", "--steps", "8", "--batch-size", "8",
            "--synthetic-train", "32", "--synthetic-test", "8", "--max-length", "24", "--micro-batch-size", "16",
            "--rank", "2", "--epsilon", "1.0", "--eval-batch-size", "8", "--canaries", "200"]


def test_audit_json_reports_both_bounds(tiny_bert_dir, tmp_path, capsys):
    from prismdp.cli import main

    out = tmp_path / "run"
    assert main(_audit_args(tiny_bert_dir, out)) == 0
    rep = json.loads((out / "audit.json").read_text())
    f = rep["fdp"]
    assert f["verdict"] == "consistent" and f["gdp_correct"] <= f["gdp_guesses"] <= 200
    assert f["mechanism_sigma_upper_bound"] is None or f["mechanism_sigma_upper_bound"] >= rep["noise_multiplier"]
    assert (f["mechanism_eps_lower_bound"] or 0.0) <= rep["epsilon"]
    # the f-DP numbers are those of fdp.py on the saved scores and coins
    coins = json.loads((out / "audit-canaries.json").read_text())
    s, b = np.array(coins["scores"]), np.array(coins["included"], bool)
    assert f["gdp_mu_lower_bound"] == audit_one_run_fdp(s[b], s[~b], delta=rep["delta"]).mu_lower_bound
    printed = capsys.readouterr().out
    assert "epsilon >=" in printed and "f-DP (Mahloujifar et al. 2024)" in printed and "mu >=" in printed


def test_fdp_verdict_catches_noise_secretly_scaled_down(tiny_bert_dir, tmp_path, monkeypatch):
    # as tests/test_audit.py's power test: the accountant claims epsilon 1, the mechanism adds 1 % of the noise
    from prismdp.cli import main
    from prismdp.privacy.clipping import DPConfig

    monkeypatch.setattr(DPConfig, "noise_std", property(lambda self: 0.01 * self.noise_multiplier *
                                                        self.max_grad_norm))
    out = tmp_path / "run"
    assert main(_audit_args(tiny_bert_dir, out)) == 1  # the exit code is the (eps, delta) test's
    rep = json.loads((out / "audit.json").read_text())
    f = rep["fdp"]
    assert f["verdict"] == "violation" and f["mechanism_sigma_upper_bound"] < rep["noise_multiplier"]
    assert f["mechanism_eps_lower_bound"] is None or f["mechanism_eps_lower_bound"] > rep["epsilon"]
    assert f["gdp_eps_lower_bound"] >= rep["eps_lower_bound"]  # same guesses here, the f-DP test is the sharper


def test_the_candidate_thresholds_are_fixed_before_the_coins_are_read():
    # the Bonferroni correction over K candidates holds only if the K thresholds do not depend on the coins: the same
    # scores with other coins must give the same candidates (jax_privacy's hull of the (FN, TN) counts does not)
    rng = np.random.default_rng(5)
    scores = np.round(rng.normal(size=1000), 2)  # ties included
    seen = set()
    for _ in range(20):
        bits = rng.random(1000) < 0.5
        thresholds, _, _, k = candidate_thresholds(scores[bits], scores[~bits])
        seen.add((tuple(thresholds), k))
    assert len(seen) == 1 and next(iter(seen))[1] == 10  # k = 1, 2, 4, ..., 512


def test_with_no_signal_the_bound_is_above_zero_in_at_most_the_significance_of_the_runs():
    # scores independent of the coins: "no privacy loss at all" is true, and at significance 0.05 the audit may
    # reject it (a mu bound above 0; at mu = 0 the f-DP test is the binomial test) in at most 5 % of the runs.
    # Measured at this seed: 1.8 % with the ladder; choosing among the hull's vertices, found with the coins,
    # 5.7 % (6.5 % over 4,000 other draws: scripts/audit_table.py --simulate --rule hull).
    rng = np.random.default_rng(2024)
    runs, alarms = 3000, 0
    for _ in range(runs):
        bits, scores = rng.random(1000) < 0.5, rng.normal(size=1000)
        alarms += audit_one_run_fdp(scores[bits], scores[~bits], delta=1e-5).mu_lower_bound > 0
    assert alarms / runs <= 0.05, alarms / runs
