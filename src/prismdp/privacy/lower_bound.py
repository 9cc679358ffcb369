"""A lower bound on the epsilon of T Poisson-subsampled Gaussian steps, from one family of distinguishing tests.

Pure math (numpy / scipy), independent of the accountants.  Take one unit whose gradient is a vector of norm C (the
sensitivity) and look, in every step, at the noisy sum projected on that vector, in units of C: without the unit each
step's output is ``N(0, sigma^2)`` (law ``Q``); with it, ``N(1, sigma^2)`` with probability ``q`` and ``N(0, sigma^2)``
otherwise (law ``P``).  For any event ``S``, ``delta(eps) >= P(S) - e^eps Q(S)``, so ``P(S) > delta`` gives

    eps(delta) >= log(P(S) - delta) - log Q(S).

The events used are "at least ``k`` of the ``T`` outputs exceed ``t``", over a grid of thresholds ``t`` and counts
``k``: the counts are binomial under both laws.  ``Q(S)`` is bounded from above (the smaller of ``C(T, k) a^k`` and
Chernoff's ``exp(-T KL(k/T || a))``, ``a`` the one-step tail, all in logs, so no underflow makes the bound unsound);
``P(S)`` is computed exactly.  Every accountant
returns an upper bound on the same mechanism's epsilon, so each must answer at least this
(tests/test_privacy_properties.py), and where this bound already exceeds the largest trusted epsilon the answer is
``inf`` without running an accountant (issue 42: PRV's grid at sigma 0.01 would have needed 136 GiB).
"""

from __future__ import annotations

import numpy as np
from scipy.special import gammaln
from scipy.stats import binom, norm

__all__ = ["epsilon_lower_bound"]

_UNIT_THRESHOLDS = np.linspace(0.0, 1.5, 16)  # t in units of the sensitivity ...
_SIGMA_THRESHOLDS = np.linspace(0.5, 8.0, 16)  # ... and in units of sigma
_COUNTS = 48  # counts k per threshold, spaced geometrically in [1, T]


def epsilon_lower_bound(sigma: float, sample_rate: float, steps: int, delta: float) -> float:
    """The largest ``log(P(S) - delta) - log Q(S)`` over the tests (module docstring); ``-inf`` if none has
    ``P(S) > delta``, ``inf`` if one has ``Q(S) = 0`` (a noiseless-looking step: tiny sigma).  Validated inputs:
    ``sigma > 0``, ``0 < q <= 1``, ``steps >= 1``, ``0 < delta < 1``."""
    t = np.concatenate([_UNIT_THRESHOLDS, sigma * _SIGMA_THRESHOLDS])[:, None]
    k = np.unique(np.geomspace(1, steps, min(_COUNTS, steps)).round().astype(np.int64))[None, :]
    log_a = norm.logsf(t / sigma)  # one step's tail without the unit; with it the tail is b >= a
    b = np.minimum(1.0, (1 - sample_rate) * np.exp(log_a) + sample_rate * norm.sf((t - 1) / sigma))
    log_p = binom.logsf(k - 1, steps, b)  # P(count >= k)
    log_binom = gammaln(steps + 1.0) - gammaln(k + 1.0) - gammaln(steps - k + 1.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x = k / steps  # Chernoff: Q(count >= k) <= exp(-T KL(x || a)) for x > a
        rest = np.where(x < 1, (1 - x) * (np.log(np.where(x < 1, 1 - x, 1.0)) - norm.logcdf(t / sigma)), 0.0)
        chernoff = np.where(x > np.exp(log_a), -steps * (x * (np.log(x) - log_a) + rest), 0.0)
        log_q = np.minimum(0.0, np.minimum(log_binom + k * log_a, chernoff))  # and <= C(T, k) a^k
        gap = np.exp(log_p) - delta
        bound = np.where(gap > 0, np.log(np.where(gap > 0, gap, 1.0)) - log_q, -np.inf)
    return float(np.max(bound))
