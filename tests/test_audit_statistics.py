"""prismdp.audit.statistics against published and independently computed values.

References:
- jax_privacy's own test ``tests/auditing_test.py::test_epsilon_one_run_close`` (google-deepmind/jax_privacy): 10,000
  in- and 10,000 out-canaries with deterministic normal scores (quantiles of N(shift, 1) and N(0, 1)), significance
  0.05, delta 1e-6 -> 1.13346 (shift 1), 2.311945 (shift 2), 4.395568 (shift 4), 0 (shift 0).
- Values computed with jax-privacy 2.0.0 from PyPI (CPU, in a throwaway venv, not a dependency of prismdp):
    python3 -m venv /tmp/jaxp && /tmp/jaxp/bin/pip install jax-privacy jax jaxlib
    /tmp/jaxp/bin/python -c "import numpy as np; from jax_privacy import auditing; \
      rng = np.random.default_rng(SEED); ins = np.round(rng.normal(SHIFT, 1, N_IN), DEC); \
      outs = np.round(rng.normal(0, 1, N_OUT), DEC); \
      print(auditing.CanaryScoreAuditor(ins, outs).epsilon_one_run(0.05, DELTA)); \
      print(auditing._one_run_p_value(M, N_GUESS, N_CORRECT, EPS, DELTA))"
  Rounding the scores to DEC decimals makes ties, so the hull and the Bonferroni count are exercised.
"""

import numpy as np
import pytest
import scipy.stats

from prismdp.audit import epsilon_one_run, one_run_p_value
from prismdp.audit.statistics import candidate_thresholds, hull_thresholds, ladder_thresholds


def _deterministic_normal(mu: float, n: int) -> np.ndarray:
    return scipy.stats.norm.ppf(np.linspace(0, 1, n, endpoint=False) + 1 / (2 * n)) + mu


@pytest.mark.parametrize("shift,expected", [(0, 0.0), (1, 1.13346), (2, 2.311945), (4, 4.395568)])
def test_epsilon_one_run_published_values(shift, expected):
    n = 10_000
    eps = epsilon_one_run(_deterministic_normal(shift, n), _deterministic_normal(0, n), delta=1e-6,
                          significance=0.05, threshold_rule="hull")
    assert eps == pytest.approx(expected, rel=1e-5, abs=1e-9)


# (seed, n_in, n_out, shift, decimals, delta) -> jax-privacy 2.0.0's epsilon_one_run(0.05, delta)
JAX_PRIVACY = [
    ((0, 50, 50, 1.5, 6, 1e-05), 1.0063812113852517),
    ((0, 50, 50, 1.5, 6, 3e-4), 0.572706670432447),
    ((1, 100, 100, 2.0, 1, 1e-05), 1.5821330811196275),
    ((1, 100, 100, 2.0, 1, 3e-4), 0.6159684813345618),
    ((2, 37, 63, 3.0, 6, 1e-05), 1.7465200098430431),
    ((2, 37, 63, 3.0, 6, 3e-4), 1.427942337376904),
    ((3, 500, 500, 1.0, 6, 1e-05), 1.2465703386319007),
    ((3, 500, 500, 1.0, 6, 3e-4), 0.0),
    ((4, 200, 300, 2.5, 2, 1e-05), 2.5014681547920556),
    ((4, 200, 300, 2.5, 2, 3e-4), 0.26723006383587783),
]


@pytest.mark.parametrize("case,expected", JAX_PRIVACY)
def test_epsilon_one_run_matches_jax_privacy(case, expected):
    seed, n_in, n_out, shift, decimals, delta = case
    rng = np.random.default_rng(seed)
    ins = np.round(rng.normal(shift, 1, n_in), decimals)
    outs = np.round(rng.normal(0, 1, n_out), decimals)
    assert epsilon_one_run(ins, outs, delta=delta, threshold_rule="hull") == pytest.approx(expected, rel=1e-4,
                                                                                        abs=1e-9)


@pytest.mark.parametrize("args,expected", [
    ((100, 50, 45, 1.0, 1e-05), 0.003249361729548418),
    ((1000, 100, 90, 2.0, 1e-06), 0.3427973328418114),
    ((1000, 100, 60, 0.5, 0.001), 0.8459037403755488),
    ((10, 10, 10, 0.5, 0.1), 0.35277426921319543),
])
def test_one_run_p_value_matches_jax_privacy(args, expected):
    assert one_run_p_value(*args) == pytest.approx(expected, rel=1e-6)


def test_p_value_delta_zero_is_the_binomial_tail():
    # with delta = 0 the bound is exactly P[Binomial(n_guess, e^eps/(1+e^eps)) >= n_correct]
    p = np.exp(1.0) / (1 + np.exp(1.0))
    assert one_run_p_value(100, 40, 35, 1.0, 0.0) == pytest.approx(scipy.stats.binom.sf(34, 40, p), rel=1e-12)


def test_hull_keeps_only_convex_vertices():
    # thresholds 0, 1, 2, 3, 4, inf give (FN, TN) = (0,0) (0,1) (1,2) (2,3) (3,4) (4,4): (1,2) and (2,3) lie on the
    # chord from (0,1) to (3,4), so they are no candidates (and do not count in the Bonferroni correction)
    th, fn, tn = hull_thresholds([1, 2, 3, 4], [0, 1, 2, 3])
    assert list(th) == [0, 1, 4, np.inf]
    assert list(zip(fn, tn)) == [(0, 0), (0, 1), (3, 4), (4, 4)]


def test_ladder_guesses_the_top_1_2_4_8_scores_hand_worked():
    # pooled scores 5 4 3 3 2 1 0 0 (in: 5 3 2 0, out: 4 3 1 0): the 1st, 2nd, 4th and 8th highest are 5, 4, 3, 0,
    # so the guesses are the top 1, 2, 4 and all 8 (ties at a threshold are all guessed), then none (+inf)
    th, fn, tn = ladder_thresholds([5, 3, 2, 0], [4, 3, 1, 0])
    assert list(th) == [5, 4, 3, 0, np.inf]
    assert list(zip(fn, tn)) == [(3, 4), (3, 3), (2, 2), (0, 0), (4, 4)]
    assert candidate_thresholds([5, 3, 2, 0], [4, 3, 1, 0])[3] == 4  # K = floor(log2 8) + 1, fixed in advance
    assert candidate_thresholds([5, 3, 2], [4, 3, 1, 0])[3] == 3  # m = 7: top 1, 2, 4
    with pytest.raises(ValueError, match="threshold_rule must be one of"):
        candidate_thresholds([1.0], [0.0], "best")


def test_bound_stays_below_the_truth_of_a_known_mechanism():
    # randomised response at eps = 1: each canary's score is its bit, flipped with prob 1/(1+e); the audit may not
    # claim more than 1 (it is a lower bound at 95 % confidence; 20 independent audits, none above)
    rng = np.random.default_rng(7)
    p_keep = np.e / (1 + np.e)
    for _ in range(20):
        bits = rng.random(1000) < 0.5
        shown = np.where(rng.random(1000) < p_keep, bits, ~bits).astype(float)
        eps = epsilon_one_run(shown[bits], shown[~bits], delta=1e-5)
        assert eps <= 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(in_scores=[], out_scores=[1.0], delta=1e-5), "non-empty"),
    (dict(in_scores=[1.0], out_scores=[np.nan], delta=1e-5), "finite"),
    (dict(in_scores=[1.0], out_scores=[0.0], delta=0.0), "delta"),
    (dict(in_scores=[1.0], out_scores=[0.0], delta=1e-5, significance=1.5), "significance"),
])
def test_epsilon_one_run_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        epsilon_one_run(**kwargs)
