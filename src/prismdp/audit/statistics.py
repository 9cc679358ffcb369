"""The statistics of a one-run privacy audit (Steinke, Nasr and Jagielski 2023, "Privacy Auditing with One (1)
Training Run", arXiv:2305.08846): pure functions of canary scores, no training here.

An auditor draws m canaries, includes each independently with probability 1/2, trains once, scores every canary and
*guesses* "included" for the canaries whose score reaches a threshold (one-sided guesses: no guess below it).  If the
run is (eps, delta)-DP, the number of correct guesses among ``n_guess`` is stochastically dominated by a
Binomial(n_guess, e^eps / (1 + e^eps)) up to a delta term (their Theorem 3.1 / Proposition 5.2), which gives the
p-value :func:`one_run_p_value`.  The largest eps whose claim is rejected at the significance level is a lower bound
on the run's true epsilon with confidence 1 - significance.

:func:`epsilon_one_run` tries several thresholds and reports the best, so it pays for the choice with a Bonferroni
correction over the candidates, each tested at significance / K.  The correction is valid only if the candidates are
fixed before the coins are read.  The default rule, ``threshold_rule="ladder"`` (:func:`ladder_thresholds`), guesses the
top k of all m scores for k = 1, 2, 4, ... up to m: a family set by the scores alone, of size K = floor(log2 m) + 1.
``threshold_rule="hull"`` (:func:`hull_thresholds`) is google-deepmind/jax_privacy's rule (``CanaryScoreAuditor
.epsilon_one_run`` with its default ``Bonferroni()`` strategy; the tests check the two agree): the vertices of the
upper convex hull of the (false-negative, true-negative) counts over all thresholds.  Those vertices are found with
the coins, so the correction over them is not valid: with no signal at all (m = 1000, 4,000 draws) it rejected
"no privacy loss" in 6.5 % of the draws at significance 0.05, the ladder in 1.7 % (docs/privacy-audit.md).  The hull
is kept to compare with jax_privacy and the published values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import scipy.optimize
import scipy.stats

__all__ = ["OneRunAudit", "THRESHOLD_RULES", "audit_one_run", "candidate_thresholds", "epsilon_one_run", "guess_counts",
           "hull_thresholds", "ladder_thresholds", "one_run_p_value"]


def _check_counts(m: int, n_guess: int, n_correct: int) -> None:
    for name, v in (("m", m), ("n_guess", n_guess), ("n_correct", n_correct)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    if not n_correct <= n_guess <= m:
        raise ValueError(f"need n_correct <= n_guess <= m, got n_correct={n_correct}, n_guess={n_guess}, m={m}")


def one_run_p_value(m: int, n_guess: int, n_correct: int, eps: float, delta: float) -> float:
    """P-value of "the run is (eps, delta)-DP" after ``n_correct`` of ``n_guess`` guesses about ``m`` canaries were
    right.

    With ``p = e^eps / (1 + e^eps)`` and ``B ~ Binomial(n_guess, p)`` (Steinke et al. 2023, Prop. 5.2):
    ``P[correct >= v] <= P[B >= v] + 2 m delta max_{1 <= i <= v} P[v - i <= B < v] / i``  (``v = n_correct``),
    capped at 1.
    """
    _check_counts(m, n_guess, n_correct)
    if not eps >= 0 or not 0 <= delta <= 1:
        raise ValueError(f"need eps >= 0 and delta in [0, 1], got eps={eps!r}, delta={delta!r}")
    p = 1.0 / (1.0 + math.exp(-eps)) if eps < 700 else 1.0
    tail = float(scipy.stats.binom.sf(n_correct - 1, n_guess, p))  # P[B >= v]
    if delta == 0 or n_correct == 0:
        return min(tail, 1.0)
    i = np.arange(1, n_correct + 1)
    # P[v - i <= B < v] = P[B >= v - i] - P[B >= v]
    window = scipy.stats.binom.sf(n_correct - i - 1, n_guess, p) - tail
    return min(tail + 2 * m * delta * float(np.max(window / i)), 1.0)


def hull_thresholds(in_scores: Sequence[float], out_scores: Sequence[float]) -> tuple[np.ndarray, np.ndarray,
                                                                                         np.ndarray]:
    """The candidate thresholds and their (false-negative, true-negative) counts.

    Thresholds are the distinct scores and +inf; a canary is guessed "in" when its score is ``>=`` the threshold.
    Returned are only the vertices of the upper convex hull of the points (FN, TN) in threshold order (points on or
    below a chord of two others are dominated by randomising between those two), as ``(thresholds, fn, tn)``.
    """
    ins, outs = np.sort(np.asarray(in_scores, float)), np.sort(np.asarray(out_scores, float))
    thresholds = np.append(np.union1d(ins, outs), np.inf)
    fn = np.searchsorted(ins, thresholds, side="left")  # in-canaries below the threshold
    tn = np.searchsorted(outs, thresholds, side="left")
    keep: list[int] = []
    for k in range(len(thresholds)):  # monotone chain; points already sorted by FN (and TN)
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            d1x, d1y = int(fn[b] - fn[a]), int(tn[b] - tn[a])
            d2x, d2y = int(fn[k] - fn[b]), int(tn[k] - tn[b])
            if d1y * d2x - d2y * d1x > 0:  # strict right turn: b stays a vertex
                break
            keep.pop()
        keep.append(k)
    idx = np.asarray(keep)
    return thresholds[idx], fn[idx], tn[idx]


def _ladder(m: int) -> np.ndarray:
    """The registered numbers of guesses for m canaries: 1, 2, 4, ..., the largest power of 2 at most m."""
    return 2 ** np.arange(int(math.log2(m)) + 1)


def ladder_thresholds(in_scores: Sequence[float], out_scores: Sequence[float]) -> tuple[np.ndarray, np.ndarray,
                                                                                           np.ndarray]:
    """The candidate thresholds fixed before the coins are read, and their (false-negative, true-negative) counts.

    The k-th highest of all m scores (in and out pooled: a function of the scores alone) for k = 1, 2, 4, ..., the
    largest power of 2 at most m; a canary is guessed "in" when its score is ``>=`` the threshold (ties at the k-th
    score are all guessed: more than k guesses).  Tied thresholds are listed once; +inf (no guess) comes last.  The
    Bonferroni count is the ladder's length K = floor(log2 m) + 1 (:func:`candidate_thresholds`), fixed in advance.
    """
    ins, outs = np.sort(np.asarray(in_scores, float)), np.sort(np.asarray(out_scores, float))
    pooled = np.sort(np.concatenate([ins, outs]))[::-1]
    ks = _ladder(pooled.size)
    thresholds = np.append(np.unique(pooled[ks - 1])[::-1], np.inf)
    return thresholds, np.searchsorted(ins, thresholds, side="left"), np.searchsorted(outs, thresholds, side="left")


THRESHOLD_RULES = ("ladder", "hull")


def candidate_thresholds(in_scores: Sequence[float], out_scores: Sequence[float], rule: str = "ladder"
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(thresholds, fn, tn, K)``: the candidates of ``rule`` (``"ladder"``: :func:`ladder_thresholds`; ``"hull"``:
    :func:`hull_thresholds`) and the number K of tests the Bonferroni correction divides the significance by (the
    ladder's registered length; jax_privacy's count of the hull's vertices, +inf included)."""
    if rule == "ladder":
        return (*ladder_thresholds(in_scores, out_scores), len(_ladder(len(in_scores) + len(out_scores))))
    if rule == "hull":
        thresholds, fn, tn = hull_thresholds(in_scores, out_scores)
        return thresholds, fn, tn, len(thresholds)
    raise ValueError(f"threshold_rule must be one of {THRESHOLD_RULES}, got {rule!r}")


def guess_counts(in_scores: Sequence[float], out_scores: Sequence[float], threshold: float) -> tuple[int, int]:
    """``(n_guess, n_correct)`` when every canary scoring ``>= threshold`` is guessed "in"."""
    tp = int(np.sum(np.asarray(in_scores) >= threshold))
    fp = int(np.sum(np.asarray(out_scores) >= threshold))
    return tp + fp, tp


def _largest_rejected_eps(m: int, n_guess: int, n_correct: int, alpha: float, delta: float, floor: float) -> float:
    """The largest eps >= ``floor`` whose claim is rejected at level ``alpha`` (``floor`` if none is)."""
    if n_guess == 0 or one_run_p_value(m, n_guess, n_correct, floor, 0.0) > alpha:
        return floor  # not even the delta-free claim at `floor` is rejected; the p-value grows with eps and delta

    def gap(eps: float) -> float:  # > 0 while the (eps, delta) claim is rejected
        return alpha - one_run_p_value(m, n_guess, n_correct, eps, delta)

    if gap(floor) <= 0:
        return floor
    lo, hi = floor, max(1.0, 2 * floor)
    while gap(hi) > 0:
        lo, hi = hi, 2 * hi
    return float(scipy.optimize.brentq(gap, lo, hi, xtol=1e-10, rtol=1e-12))


@dataclass(frozen=True)
class OneRunAudit:
    """The outcome of :func:`audit_one_run`: the bound and the guesses that gave it."""

    eps_lower_bound: float
    threshold: float  # guess "in" at scores >= threshold (+inf: no guess gave a bound)
    guesses: int
    correct: int
    candidates: int  # thresholds in the Bonferroni correction
    m: int
    significance: float
    delta: float


def audit_one_run(in_scores: Sequence[float], out_scores: Sequence[float], *, delta: float,
                  significance: float = 0.05, threshold_rule: str = "ladder") -> OneRunAudit:
    """:func:`epsilon_one_run` with the threshold, the number of guesses and of correct ones that gave the bound."""
    ins, outs = np.asarray(in_scores, float), np.asarray(out_scores, float)
    if ins.ndim != 1 or outs.ndim != 1 or ins.size == 0 or outs.size == 0:
        raise ValueError("in_scores and out_scores must be non-empty 1-d sequences of scores")
    if not (np.isfinite(ins).all() and np.isfinite(outs).all()):
        raise ValueError("canary scores must be finite")
    if not 0 < significance < 1:
        raise ValueError(f"significance must be in (0, 1), got {significance!r}")
    if not 0 < delta <= 1:
        raise ValueError(f"delta must be in (0, 1], got {delta!r}")
    thresholds, fn, tn, tests = candidate_thresholds(ins, outs, threshold_rule)
    m, alpha = ins.size + outs.size, significance / tests
    n_correct = ins.size - fn
    n_guess = n_correct + outs.size - tn
    best, best_k = 0.0, len(fn) - 1  # the last vertex is +inf: no guesses
    # most precise thresholds first, so later ones are usually ruled out by the cheap delta-free test
    for k in sorted(range(len(fn)), key=lambda k: -(n_correct[k] + 1) / (n_guess[k] + 2)):
        g, c = int(n_guess[k]), int(n_correct[k])
        if g == 0 or c / g <= 1.0 / (1.0 + math.exp(-best)):
            continue  # precision at most e^best / (1 + e^best): cannot reject a claim above `best`
        eps = _largest_rejected_eps(m, g, c, alpha, delta, best)
        if eps > best:
            best, best_k = eps, k
    return OneRunAudit(best, float(thresholds[best_k]), int(n_guess[best_k]), int(n_correct[best_k]), tests, m,
                       significance, delta)


def epsilon_one_run(in_scores: Sequence[float], out_scores: Sequence[float], *, delta: float,
                    significance: float = 0.05, threshold_rule: str = "ladder") -> float:
    """Lower bound on epsilon, with confidence ``1 - significance``, from the scores of the included (``in_scores``)
    and excluded (``out_scores``) canaries of one run; higher scores mean "more likely included".

    The threshold is the best of the candidates of ``threshold_rule`` (:func:`candidate_thresholds`), each tested at
    ``significance / K`` (Bonferroni).  Returns 0 when no claim is rejected.
    """
    return audit_one_run(in_scores, out_scores, delta=delta, significance=significance,
                         threshold_rule=threshold_rule).eps_lower_bound
