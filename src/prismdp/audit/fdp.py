"""The f-DP statistics of a one-run audit (Mahloujifar, Melis and Chaudhuri 2024, "Auditing f-Differential Privacy
in One Run", arXiv:2410.22235): pure functions of canary scores, beside :mod:`.statistics`' (epsilon, delta) test.

Same game as :mod:`.statistics`: m canaries, each in the run with probability 1/2; the auditor guesses "in" for the
``n_guess`` canaries scoring at or above a threshold and ``n_correct`` of them were in.  Instead of a Binomial tail
for an (eps, delta) claim, the claim tested is "the run is f-DP with respect to each canary" for a whole trade-off
curve f, through its *blow-up* ``fbar(x) = 1 - f(x)`` (the largest probability an event can have with the canary
flipped when it has probability x without) and its inverse.

The test (the paper's recursion, ``audit_rh_with_cap`` in its code).  Suppose the claim holds and the auditor gets at
least ``c = n_correct`` of ``c' = n_guess`` right with probability tau.  Write ``r_i`` (``h_i``) for the expected
fraction of the m canaries that are guessed correctly (wrongly) in an outcome with at least i correct guesses.  At
``i = c`` these are at least ``tau c / m`` and ``tau (c' - c) / m``; flipping one correctly guessed canary turns an
outcome with >= i + 1 correct into one with >= i where it is guessed wrongly, so f-DP (averaged over the canaries,
``fbar^-1`` being convex) gives ``h_i >= fbar^-1(r_{i+1})``; an outcome with exactly i correct adds to r and h in the
ratio ``i : (c' - i)``.  Going down from ``i = c - 1`` to 0 with the least h (and so the least r) allowed::

    h_i = max(h_{i+1}, fbar^-1(r_{i+1})),     r_i = r_{i+1} + i / (c' - i) * (h_i - h_{i+1})

and every outcome has c' guesses, so ``r_0 + h_0 = c' / m``.  If already the least ``r_0 + h_0`` exceeds ``c' / m``
at ``tau = significance``, the observed count has probability below the significance under the claim: it is
rejected (:func:`fdp_gap` > 0).  The gap grows with tau and with ``fbar^-1``, so a one-parameter family of curves
ordered by privacy has a largest rejected level, found by root finding.

Curves: Gaussian DP (:func:`gdp_blow_up_inverse`, ``fbar^-1(y) = Phi(Phi^-1(y) - mu)``; the bound is a mu, and the
epsilon that mu-GDP gives at the run's delta, Dong, Roth and Su 2019, Cor. 2.13), and the run's own mechanism, a
Poisson-subsampled Gaussian composed over the run's steps (:func:`subsampled_gaussian_blow_up_inverse`, from
dp-accounting's PLD; the bound is the noise multiplier sigma whose curve is rejected and the accountant's epsilon
at that sigma).  The threshold is chosen as in :mod:`.statistics`: every candidate of the threshold rule (by default
the ladder of top-k guesses fixed before the coins are read) tested at ``significance / K`` (Bonferroni), so the
bound holds with confidence ``1 - significance`` after the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import scipy.optimize
import scipy.special

from .statistics import _check_counts, candidate_thresholds

__all__ = ["FdpAudit", "MechanismAudit", "audit_one_run_fdp", "audit_one_run_mechanism", "fdp_gap",
           "gdp_blow_up_inverse", "gdp_delta", "gdp_epsilon", "mu_one_run", "profile_blow_up_inverse",
           "subsampled_gaussian_blow_up_inverse"]

BlowUpInverse = Callable[[float], float]
PLD_DISCRETIZATION = 1e-3  # dp-accounting's PLD grid for the mechanism's curve (pessimistic rounding: conservative)
EPS_GRID = np.linspace(-2.0, 40.0, 841)  # epsilons at which the mechanism's delta(eps) profile is read


def gdp_blow_up_inverse(mu: float) -> BlowUpInverse:
    """``fbar^-1`` of mu-GDP: ``y -> Phi(Phi^-1(y) - mu)`` (mu = 0: the identity, no privacy loss)."""
    if not mu >= 0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    ndtr, ndtri = scipy.special.ndtr, scipy.special.ndtri
    return lambda y: float(ndtr(ndtri(min(max(y, 0.0), 1.0)) - mu))


def profile_blow_up_inverse(eps: Sequence[float], delta: Sequence[float]) -> BlowUpInverse:
    """``fbar^-1`` of a mechanism that is (eps_k, delta_k)-DP for every k (both orders of each neighbouring pair).

    Each (eps_k, delta_k) bounds the blow-up by ``delta_k + e^eps_k x``, so ``fbar(x) = min(1, min_k ...)`` and
    ``fbar^-1(y) = max(0, max_k (y - delta_k) e^-eps_k)``: a finite set of pairs gives a curve below the mechanism's
    true one (a weaker claim, so a test of it is conservative), concave as every blow-up must be.
    """
    e, d = np.asarray(eps, float), np.asarray(delta, float)
    if e.shape != d.shape or e.ndim != 1 or e.size == 0 or not (np.isfinite(e).all() and (d >= 0).all()):
        raise ValueError("eps and delta must be 1-d arrays of the same length, eps finite, delta >= 0")
    scale = np.exp(-e)
    return lambda y: max(0.0, float(np.max((min(y, 1.0) - d) * scale)))


def fdp_gap(blow_up_inverse: BlowUpInverse, m: int, n_guess: int, n_correct: int, significance: float) -> float:
    """``r_0 + h_0 - n_guess / m`` of the recursion above at ``tau = significance``: > 0 iff the curve is rejected.

    Stops early once the gap is positive (r and h only grow) or h stops moving (then nothing changes any more).
    """
    _check_counts(m, n_guess, n_correct)
    if not 0 < significance < 1:
        raise ValueError(f"significance must be in (0, 1), got {significance!r}")
    budget = n_guess / m
    r, h = significance * n_correct / m, significance * (n_guess - n_correct) / m
    for i in range(n_correct - 1, -1, -1):
        h_next = max(h, blow_up_inverse(min(r, 1.0)))
        if h_next == h or r + h > budget:
            break
        r, h = r + i / (n_guess - i) * (h_next - h), h_next
    return r + h - budget


def gdp_delta(mu: float, eps: float) -> float:
    """delta(eps) of mu-GDP: ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` (Dong, Roth, Su 2019, Cor. 2.13)."""
    if mu <= 0:
        return 0.0
    lcdf = scipy.special.log_ndtr
    a, b = lcdf(-eps / mu + mu / 2), eps + lcdf(-eps / mu - mu / 2)
    return float(np.exp(a) * -np.expm1(b - a)) if b < a else 0.0


def gdp_epsilon(mu: float, delta: float) -> float:
    """The least eps >= 0 with ``gdp_delta(mu, eps) <= delta``: the (eps, delta) guarantee of mu-GDP."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2
    return float(scipy.optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


def _largest_rejected(gap: Callable[[float], float], lo: float) -> float:
    """The root of a gap decreasing in the privacy level, above ``lo`` where it is > 0."""
    hi = max(1.0, 2 * lo)
    while gap(hi) > 0:
        lo, hi = hi, 2 * hi
        if hi > 1e6:  # a blow-up inverse tends to 0 as the privacy level grows: a curve that is not one
            raise ValueError("the claim is rejected at every privacy level: the curve is not a blow-up inverse")
    return float(scipy.optimize.brentq(gap, lo, hi, xtol=1e-9, rtol=1e-10))


def mu_one_run(m: int, n_guess: int, n_correct: int, significance: float, floor: float = 0.0) -> float:
    """The largest mu whose mu-GDP claim ``n_correct`` of ``n_guess`` correct guesses reject at ``significance``
    (``floor`` if none above it is)."""

    def gap(mu: float) -> float:
        return fdp_gap(gdp_blow_up_inverse(mu), m, n_guess, n_correct, significance)

    if n_guess == 0 or gap(floor) <= 0:
        return floor
    return _largest_rejected(gap, floor)


@dataclass(frozen=True)
class FdpAudit:
    """The outcome of :func:`audit_one_run_fdp`: the Gaussian-DP bound and the guesses that gave it."""

    mu_lower_bound: float
    eps_lower_bound: float  # the epsilon of mu_lower_bound-GDP at delta
    threshold: float  # guess "in" at scores >= threshold (+inf: no guess gave a bound)
    guesses: int
    correct: int
    candidates: int  # thresholds in the Bonferroni correction
    m: int
    significance: float
    delta: float


def _candidates(in_scores, out_scores, significance: float, delta: float, rule: str):
    ins, outs = np.asarray(in_scores, float), np.asarray(out_scores, float)
    if ins.ndim != 1 or outs.ndim != 1 or ins.size == 0 or outs.size == 0:
        raise ValueError("in_scores and out_scores must be non-empty 1-d sequences of scores")
    if not (np.isfinite(ins).all() and np.isfinite(outs).all()):
        raise ValueError("canary scores must be finite")
    if not 0 < significance < 1:
        raise ValueError(f"significance must be in (0, 1), got {significance!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    thresholds, fn, tn, tests = candidate_thresholds(ins, outs, rule)
    correct = ins.size - fn
    guesses = correct + outs.size - tn
    m = ins.size + outs.size
    # a threshold whose guesses do not reject even "no privacy loss at all" (fbar^-1 = identity) rejects nothing
    alpha = significance / tests
    live = [k for k in range(len(fn)) if guesses[k] > 0
            and fdp_gap(lambda y: y, m, int(guesses[k]), int(correct[k]), alpha) > 0]
    return thresholds, guesses, correct, m, alpha, live, tests


def audit_one_run_fdp(in_scores: Sequence[float], out_scores: Sequence[float], *, delta: float,
                      significance: float = 0.05, threshold_rule: str = "ladder") -> FdpAudit:
    """Lower bound on the run's Gaussian-DP mu (and the epsilon it gives at ``delta``), with confidence
    ``1 - significance``, from the scores of the included and excluded canaries (higher = "more likely in");
    ``threshold_rule`` as in :func:`prismdp.audit.statistics.candidate_thresholds`."""
    thresholds, guesses, correct, m, alpha, live, tests = _candidates(in_scores, out_scores, significance, delta,
                                                                      threshold_rule)
    best, best_k = 0.0, len(thresholds) - 1  # the last vertex is +inf: no guesses
    for k in sorted(live, key=lambda k: -(correct[k] + 1) / (guesses[k] + 2)):  # most precise first
        mu = mu_one_run(m, int(guesses[k]), int(correct[k]), alpha, floor=best)
        if mu > best:
            best, best_k = mu, k
    return FdpAudit(best, gdp_epsilon(best, delta), float(thresholds[best_k]), int(guesses[best_k]),
                    int(correct[best_k]), tests, m, significance, delta)


# ----------------------------------------------------------------------------------- the run's own mechanism


def subsampled_gaussian_blow_up_inverse(sigma: float, sample_rate: float, steps: int) -> BlowUpInverse:
    """``fbar^-1`` of ``steps`` compositions of a Poisson-subsampled Gaussian (noise multiplier ``sigma``, rate
    ``sample_rate``; add-or-remove neighbours, the larger delta of the two orders), from dp-accounting's PLD
    (pessimistic rounding) read at :data:`EPS_GRID`: a curve at or below the mechanism's (conservative)."""
    from dp_accounting.pld import privacy_loss_distribution

    one = privacy_loss_distribution.from_gaussian_mechanism(sigma, sampling_prob=sample_rate,
                                                            value_discretization_interval=PLD_DISCRETIZATION)
    deltas = np.asarray(one.self_compose(int(steps)).get_delta_for_epsilon(EPS_GRID), float)
    return profile_blow_up_inverse(EPS_GRID, np.clip(deltas, 0.0, 1.0))


@dataclass(frozen=True)
class MechanismAudit:
    """The outcome of :func:`audit_one_run_mechanism`: the least private mechanism of the run's family (its
    noise multiplier) that the guesses do not rule out, and the guesses that gave it."""

    sigma_upper_bound: float  # every noise multiplier above this is rejected (inf: none is)
    threshold: float
    guesses: int
    correct: int
    candidates: int
    m: int
    significance: float


def audit_one_run_mechanism(in_scores: Sequence[float], out_scores: Sequence[float], *, sample_rate: float,
                            steps: int, delta: float, significance: float = 0.05,
                            start: float = 1.0, rtol: float = 1e-3, threshold_rule: str = "ladder") -> MechanismAudit:
    """The f-DP audit against the curves of the run's own mechanism family: ``steps`` Poisson-subsampled Gaussian
    steps at ``sample_rate`` with noise multiplier s.  A larger s claims more privacy; the claim "the run is as
    private as s" is rejected for every s above the returned ``sigma_upper_bound`` (with confidence
    ``1 - significance``, Bonferroni over the candidates of ``threshold_rule``).  ``start`` is where the search
    begins (the run's sigma); the bound is found to relative precision ``rtol``."""
    thresholds, guesses, correct, m, alpha, live, tests = _candidates(in_scores, out_scores, significance, delta,
                                                                      threshold_rule)
    if not live:
        return MechanismAudit(math.inf, math.inf, 0, 0, tests, m, significance)
    cache: dict[float, tuple[float, int]] = {}

    def worst(log_s: float) -> tuple[float, int]:  # the largest gap over the thresholds, and where
        if log_s not in cache:
            inv = subsampled_gaussian_blow_up_inverse(math.exp(log_s), sample_rate, steps)
            gaps = [fdp_gap(inv, m, int(guesses[k]), int(correct[k]), alpha) for k in live]
            cache[log_s] = (max(gaps), live[int(np.argmax(gaps))])
        return cache[log_s]

    lo = hi = math.log(start)
    if worst(lo)[0] > 0:  # rejected at the start: walk down to a level not rejected
        while worst(lo)[0] > 0:
            hi, lo = lo, lo - math.log(4)
            if lo < math.log(start) - math.log(4) * 12:
                raise ValueError("the claim is rejected at every noise level: the curve is not a blow-up inverse")
    else:  # not rejected: walk up; a level too private to reach means "no bound" (sigma = inf)
        while worst(hi)[0] <= 0:
            lo, hi = hi, hi + math.log(4)
            if hi > math.log(start) + math.log(4) * 8:
                return MechanismAudit(math.inf, math.inf, 0, 0, tests, m, significance)
    root = scipy.optimize.brentq(lambda s: worst(s)[0], lo, hi, xtol=rtol / 2)
    k = worst(hi)[1]
    return MechanismAudit(math.exp(root), float(thresholds[k]), int(guesses[k]), int(correct[k]), tests,
                          m, significance)
