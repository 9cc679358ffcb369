"""The statistics of a one-run privacy audit (Steinke, Nasr and Jagielski 2023, "Privacy Auditing with One (1)
Training Run", arXiv:2305.08846): pure functions of canary scores, no training here.

An auditor draws m canaries, includes each independently with probability 1/2, trains once, scores every canary and
*guesses* "included" for the canaries whose score reaches a threshold (one-sided guesses: no guess below it).  If the
run is (eps, delta)-DP, the number of correct guesses among ``n_guess`` is stochastically dominated by a
Binomial(n_guess, e^eps / (1 + e^eps)) up to a delta term (their Theorem 3.1 / Proposition 5.2), which gives the
p-value :func:`one_run_p_value`.  The largest eps whose claim is rejected at the significance level is a lower bound
on the run's true epsilon with confidence 1 - significance.

:func:`epsilon_one_run` chooses the threshold after seeing which canaries were in, so it pays for the choice with a
Bonferroni correction over the candidate thresholds: the vertices of the upper convex hull of the (false-negative,
true-negative) counts over all score thresholds (every threshold below that hull is dominated), at significance / H
each.  This is the rule of google-deepmind/jax_privacy's ``CanaryScoreAuditor.epsilon_one_run`` (default
``Bonferroni()`` threshold strategy); the tests check the two agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import scipy.optimize
import scipy.stats

__all__ = ["OneRunAudit", "audit_one_run", "one_run_p_value", "epsilon_one_run", "guess_counts", "hull_thresholds"]


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
                  significance: float = 0.05) -> OneRunAudit:
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
    thresholds, fn, tn = hull_thresholds(ins, outs)
    m, alpha = ins.size + outs.size, significance / len(fn)
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
    return OneRunAudit(best, float(thresholds[best_k]), int(n_guess[best_k]), int(n_correct[best_k]), len(fn), m,
                       significance, delta)


def epsilon_one_run(in_scores: Sequence[float], out_scores: Sequence[float], *, delta: float,
                    significance: float = 0.05) -> float:
    """Lower bound on epsilon, with confidence ``1 - significance``, from the scores of the included (``in_scores``)
    and excluded (``out_scores``) canaries of one run; higher scores mean "more likely included".

    The threshold is the best hull vertex (:func:`hull_thresholds`), each tested at ``significance / H``
    (Bonferroni over the H vertices).  Returns 0 when no claim is rejected.
    """
    return audit_one_run(in_scores, out_scores, delta=delta, significance=significance).eps_lower_bound
