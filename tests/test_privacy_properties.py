"""Property tests of the accountants (issue 42): inputs drawn over many orders of magnitude, both directions.

Every call answers with a finite value, ``inf`` with its reason (:func:`accounting_note`), or a ``ValueError``
naming the problem, within these bounds, decided before the test was first run (not fitted to it):

* time: an ``epsilon`` call answers within 10 s and a calibration within 60 s of CPU time (one idle core).  The
  test fails only past 10x that (100 s, 600 s: a hang, the minutes of issue 42's defects), counted in the process's
  CPU time (``ITIMER_PROF``), not wall time, so a loaded CI machine does not flake;
* memory: the process's peak resident set grows by at most 1 GiB over any one call (issue 42: 136 GiB).

Where answers are finite they must be consistent with their stated errors: every accountant returns an upper bound
on the mechanism's epsilon, so each is at least the independent lower bound of :mod:`prismdp.privacy.lower_bound`;
PRV (estimate + 0.01, estimate within 0.01) is at most 0.02 above the true epsilon, hence above PLD and RDP by at
most 0.02; PLD's pessimistic rounding adds at most ``steps x interval`` (interval from
:func:`prismdp.privacy.pld.discretization`), so it exceeds PRV and RDP by at most that.

Reproducible: ``derandomize=True``, no example database.  The whole file ran in 25 s of CPU time (one process) on
this project's 2-core machine; the example counts are sized for that.
"""

import math
import resource
import signal
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from prismdp.privacy import calibrate_sigma, epsilon
from prismdp.privacy.accounting import MAX_EPSILON, MAX_SIGMA, MIN_SIGMA, accounting_note
from prismdp.privacy.lower_bound import epsilon_lower_bound
from prismdp.privacy.pld import discretization

ACCOUNTANTS = ("prv", "rdp", "pld")
SLACK = 10  # the test fails past SLACK x the stated time bound
EPSILON_CALL_S, CALIBRATION_S, MEMORY_BYTES = 10, 60, 2**30

# no shrinking: a failing example is reported as drawn (shrinking reruns slow accountant calls for minutes)
PROPERTY = settings(max_examples=10, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


def log_uniform(lo_exp: float, hi_exp: float):
    return st.floats(lo_exp, hi_exp).map(lambda e: 10.0 ** e)


SIGMAS = log_uniform(-3, 4)
RATES = st.one_of(st.just(1.0), log_uniform(-6, 0))
STEPS = st.floats(0, 7.3).map(lambda e: int(round(10 ** e)))  # 1 .. 2e7: past MAX_STEPS (1e7) is refused
DELTAS = log_uniform(-12, -1)
TARGETS = log_uniform(-2, 2.3)  # 0.01 .. 200: past MAX_EPSILON (100) is refused


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@contextmanager
def bounded(seconds: float):
    """Fail if the block uses more than ``SLACK * seconds`` of CPU time or raises the peak RSS by more than
    ``MEMORY_BYTES``."""
    def expire(*_):
        raise TimeoutError(f"past {SLACK * seconds} s of CPU time (the bound is {seconds} s)")

    before, old = _peak_rss(), signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, SLACK * seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)
    assert _peak_rss() - before <= MEMORY_BYTES, f"peak RSS grew by {(_peak_rss() - before) / 2**20:.0f} MiB"


def answer(sigma, q, steps, delta, accountant):
    """``epsilon``'s value, or the ValueError's message; checks the outcome is one of the three allowed."""
    try:
        with bounded(EPSILON_CALL_S):
            eps = epsilon(sigma, q, steps, delta, accountant)
    except ValueError as e:
        assert str(e) and ("steps" in str(e) or "delta" in str(e)), e  # names the input at fault
        return str(e)
    assert eps >= 0 and not math.isnan(eps), eps
    if math.isinf(eps):
        assert f"above {MAX_EPSILON:g}" in accounting_note(sigma, q, steps, delta, accountant)
    return eps


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
@PROPERTY
@given(sigma=SIGMAS, q=RATES, steps=STEPS, delta=DELTAS)
def test_epsilon_answers_finite_inf_with_reason_or_refuses(accountant, sigma, q, steps, delta):
    eps = answer(sigma, q, steps, delta, accountant)
    if isinstance(eps, float) and math.isfinite(eps):
        assert eps >= epsilon_lower_bound(sigma, q, max(steps, 1), delta) - 1e-9


@settings(PROPERTY, max_examples=20)
@given(sigma=SIGMAS, q=RATES, steps=STEPS, delta=DELTAS)
# found in CI (at 9.8e6 steps, 23.3 vs 1.79): PLD standing in for PRV broke PRV's 0.02 above RDP; 1.8 s here
@example(sigma=1697.0, q=0.5, steps=10**6, delta=1e-11)
def test_the_accountants_agree_within_their_stated_errors(sigma, q, steps, delta):
    answers = {a: answer(sigma, q, steps, delta, a) for a in ACCOUNTANTS}
    finite = {a: v for a, v in answers.items() if isinstance(v, float) and math.isfinite(v)}
    refused = [a for a, v in answers.items() if isinstance(v, str)]
    assert len(refused) in (0, 3), answers  # the input checks are the same for all three
    if steps == 0 or refused:
        return
    lower = epsilon_lower_bound(sigma, q, steps, delta)
    assert all(v >= lower - 1e-9 for v in finite.values()), (lower, answers)
    pld_error = steps * discretization(sigma, q)
    for a, b, error in [("prv", "pld", 0.02), ("prv", "rdp", 0.02), ("pld", "prv", pld_error),
                        ("pld", "rdp", pld_error)]:
        if a in finite and b in finite:
            assert finite[a] <= finite[b] + error + 1e-9, (a, b, answers)


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
@settings(PROPERTY, max_examples=5)
@given(target=TARGETS, q=RATES, steps=st.floats(0, 4).map(lambda e: int(round(10 ** e))), delta=DELTAS)
def test_calibration_meets_the_target_or_refuses(accountant, target, q, steps, delta):
    """Sigma of a target epsilon (up to 1e4 steps: each calibration makes ~10-20 accountant calls)."""
    try:
        with bounded(CALIBRATION_S):
            sigma = calibrate_sigma(target, delta, q, steps, accountant)
    except ValueError as e:
        assert any(w in str(e) for w in ("target_epsilon", "delta")), e
        return
    assert MIN_SIGMA / 2 <= sigma <= MAX_SIGMA * 1.01, sigma
    eps = epsilon(sigma, q, steps, delta, accountant)
    assert eps <= target, (sigma, eps)
    assert eps >= (1 - 0.005) * target or sigma < 2 * MIN_SIGMA, (sigma, eps)  # tight unless at the search floor
