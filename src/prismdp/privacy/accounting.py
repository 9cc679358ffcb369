"""Privacy accounting for T identical Poisson-subsampled Gaussian steps: Opacus' PRV and RDP accountants and Google's
dp-accounting PLD accountant (:mod:`.pld`), two independent implementations that must agree (tests/test_privacy.py).

Every DP step of the library is the same mechanism: noise multiplier ``sigma``, Poisson rate ``q``, one step of
a subsampled Gaussian with sensitivity C. A run of ``steps`` such steps is written into an Opacus accountant's
history as the single entry ``(sigma, q, steps)``, so composition costs one accountant call, not ``steps``.

- :func:`epsilon` -- epsilon spent by ``steps`` steps at ``delta`` (memoised: an accountant call is slow).
- :func:`calibrate_sigma` -- the smallest sigma whose epsilon stays at or below a target, for the exact ``steps``.
- :class:`PrivacyBudget` -- budget tracking during training; refuses a step *before* it would overspend.  Its
  per-step check costs no accountant call (epsilon grows with the steps, so a verified step count covers every
  smaller one); show the spent epsilon at a few :func:`report_steps` only (an accountant call each).

Opacus' PRV accountant returns an upper bound: its estimate plus ``eps_error`` (0.01 by default, kept here), so
PRV epsilons never fall below ~0.01. RDP uses Opacus' default orders (up to 63), which floors epsilon near 0.1 at
delta = 1e-5 for very large sigma.  PLD (pessimistic discretisation, interval 1e-4) is an upper bound too.

Epsilons above :data:`MAX_EPSILON` (100) are not trusted: such a guarantee certifies nothing, and the numerical
accountants leave their accurate range there (PRV's grid overflows to ``ln(max double) = 709.78`` for tiny sigmas, and
calibrating for them took a minute).  :func:`epsilon` reports them as ``inf``; :func:`calibrate_sigma` refuses such a
target at once.

Which accountant answers (docs/privacy.md, "Accountants"): before any accountant runs,
:func:`.lower_bound.epsilon_lower_bound` may prove epsilon above :data:`MAX_EPSILON`: the answer is then ``inf`` at
once, without allocating anything.  PRV answers only where its grid has at most :data:`PRV_MAX_POINTS` points (its
time and memory grow with them) and its epsilon is at least :data:`PRV_MIN_EPSILON` (its additive error 0.01 is then
at most a tenth of it); elsewhere the smaller of the PLD and RDP epsilons answers instead (both are upper bounds;
PLD's pessimistic rounding can add ``steps x interval``, which at millions of steps can exceed RDP's looseness:
sigma 1697, q 0.147, 9.8e6 steps, delta 1e-11 gave PLD 23.3 and RDP 1.79), and :func:`accounting_note`
(``privacy.json``'s ``accountant_note``, ``prismdp epsilon``'s stderr line) says so and why.
Step counts above :data:`MAX_STEPS` are refused.
"""

from __future__ import annotations

import math
import numbers
import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from opacus.accountants import RDPAccountant

from .lower_bound import epsilon_lower_bound
from .pld import PLDAccountant
from .prv import CachedRDPDomainPRVAccountant, grid_points

__all__ = [
    "ACCOUNTANTS",
    "accounting_note",
    "BudgetExhaustedError",
    "PrivacyBudget",
    "calibrate_sigma",
    "check_delta",
    "epsilon",
    "vacuous_delta_bound",
    "vacuous_delta_error",
    "report_steps",
]

# PRV: Opacus' PRVAccountant, bitwise, with its domain's RDP bound computed once per (sigma, q) (prismdp.privacy.prv)
ACCOUNTANTS = {"prv": CachedRDPDomainPRVAccountant, "rdp": RDPAccountant, "pld": PLDAccountant}
MAX_EPSILON = 100.0  # larger epsilons are reported as inf and refused as targets (see the module docstring)
MIN_SIGMA = 1e-2  # calibration searches sigma in [MIN_SIGMA, MAX_SIGMA]
MAX_SIGMA = 1e4
MAX_STEPS = 10**7  # longer runs are refused; steps_allowed searches up to this many steps
PRV_MAX_POINTS = 1_000_000  # a larger PRV grid: PLD or RDP answers (see the module docstring)
PRV_MIN_EPSILON = 0.1  # a smaller PRV epsilon is mostly its additive error 0.01: PLD or RDP answers
FALLBACK = ("pld", "rdp")  # where PRV cannot answer: the smaller of their two upper bounds (the module docstring)
CALIBRATION_REL_TOL = 0.005  # calibrated epsilon lands in [(1 - tol) * target, target]


# ----------------------------------------------------------------------------------------------- validation


def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {sorted(ACCOUNTANTS)}, got {accountant!r}")
    return accountant


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_sample_rate(sample_rate: Any) -> float:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real) or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be a probability in (0, 1], got {sample_rate!r}")
    return float(sample_rate)


def _check_delta(delta: Any) -> float:
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


ACCEPT_LARGE_DELTA = "--allow-large-delta (make_private(..., allow_large_delta=True))"


def check_delta(delta: Any, dataset_size: int, *, allow_large: bool = False, unit: str = "example",
                accept: str = ACCEPT_LARGE_DELTA) -> float:
    """``delta`` for a dataset of ``dataset_size`` privacy units (examples, or users): in (0, 1) and below 1/N.

    A mechanism that publishes one randomly chosen unit in the clear is (0, 1/N)-DP, so a guarantee with
    delta >= 1/N does not rule out leaking whole units; it is refused unless ``allow_large`` (the caller's explicit
    acceptance; ``accept`` names how, in the caller's terms)."""
    delta = _check_delta(delta)
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, numbers.Integral) or dataset_size < 1:
        raise ValueError(f"dataset size (N, the number of training {unit}s) must be an integer >= 1, "
                         f"got {dataset_size!r}")
    if delta * dataset_size >= 1 and not allow_large:
        suggest = 10.0 ** math.floor(math.log10(0.1 / dataset_size))
        raise ValueError(
            f"delta={delta:g} is not below 1/N = 1/{dataset_size} = {1 / dataset_size:.3g} (N = training {unit}s): "
            f"publishing one randomly chosen {unit} in the clear is already (0, 1/N)-DP, so this guarantee would not "
            f"rule out leaking a whole {unit}. Use a delta well below 1/N (e.g. {suggest:.0e}), or accept it "
            f"knowingly with {accept}")
    return delta


def vacuous_delta_error(delta: float, accountant: str, detail: str) -> ValueError:
    """The error for a delta so large that the accountant returns a negative epsilon or none (Opacus' PRV: "Cannot
    compute epsilon"): at that delta the mechanism is already (0, delta)-DP, a guarantee that says nothing."""
    return ValueError(
        f"delta={delta:g} is too large for the {accountant!r} accountant ({detail}): at this delta even epsilon 0 "
        "holds, so the guarantee says nothing. Use a delta well below 1/N (N = training examples), e.g. 1e-5")


def vacuous_delta_bound(sample_rate: float, steps: int) -> float:
    """``1 - (1 - q)^T``: the probability that a given unit is sampled at least once in ``steps`` Poisson steps.

    Whatever the noise, the runs with and without a unit differ only when it is sampled, so their total variation
    (the delta at epsilon 0) is at most this: a ``delta`` at or above it gives (0, delta)-DP at every sigma, a
    guarantee that says nothing.  Checked before any accountant call, the same for every accountant."""
    return -math.expm1(steps * math.log1p(-sample_rate)) if sample_rate < 1 else 1.0


def _check_not_vacuous(delta: float, sample_rate: float, steps: int, accountant: str) -> None:
    bound = vacuous_delta_bound(sample_rate, steps)
    if steps > 0 and delta >= bound:
        raise vacuous_delta_error(delta, accountant, f"even without noise {steps} step(s) at sample rate "
                                                     f"{sample_rate:g} are (0, {bound:.3g})-DP")


def _check_steps(name: str, steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {steps!r}")
    if steps > MAX_STEPS:
        raise ValueError(f"{name}={steps} is above {MAX_STEPS:.0e}, beyond the accountants' tested range; "
                         "train for fewer, larger steps (a higher sample rate)")
    return int(steps)


# ----------------------------------------------------------------------------------------------- epsilon


@contextmanager
def _opacus_quiet():
    """Opacus' warnings that say nothing of the result: PRV sizes its grid with an internal RDP bound, whose "optimal
    order is the largest alpha" warning is about that bound; numpy warns about log(0) in the PRV density at q = 1."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"opacus\.accountants\.analysis\.prv")
        yield


def history_epsilon(accountant: str, history: list[tuple[float, float, int]], delta: float) -> float:
    """One accountant's epsilon at ``delta`` of a history of ``(sigma, sample_rate, steps)`` entries (each ``steps``
    self-compositions of one subsampled Gaussian), ``inf`` above :data:`MAX_EPSILON`; arguments not validated, none
    of :func:`epsilon`'s rules applied."""
    acc = ACCOUNTANTS[accountant]()
    acc.history = list(history)
    with _opacus_quiet():
        eps = float(acc.get_epsilon(delta))
    return eps if math.isfinite(eps) and eps <= MAX_EPSILON else math.inf


@lru_cache(maxsize=4096)
def _run(accountant: str, sigma: float, sample_rate: float, steps: int, delta: float) -> float:
    """One accountant's epsilon for ``steps`` steps (``inf`` above :data:`MAX_EPSILON`); a negative one (only a delta
    above the delta at epsilon 0 gives one) raises :func:`vacuous_delta_error`.  Memoised (PRV's fallback and a
    direct call of the same accountant share it)."""
    eps = history_epsilon(accountant, [(sigma, sample_rate, steps)], delta)
    if eps < 0:
        raise vacuous_delta_error(delta, accountant, f"epsilon {eps:.3g}")
    return eps


def _prv(sigma: float, sample_rate: float, steps: int, delta: float) -> tuple[float, str | None]:
    """PRV's epsilon, or ``(nan, why)`` where PRV cannot answer fast (grid too large: checked first, in
    allocating) or accurately (an epsilon mostly made of its additive error)."""
    points = grid_points(sigma, sample_rate, steps, delta)
    if points > PRV_MAX_POINTS:
        return math.nan, (f"prv would discretise on {points:.2g} points, more than {PRV_MAX_POINTS:.0e} (its time "
                          "and memory grow with them)")
    eps = _run("prv", sigma, sample_rate, steps, delta)
    if eps < PRV_MIN_EPSILON:
        return math.nan, f"prv's {eps:.4g} is below {PRV_MIN_EPSILON:g}, where its additive error 0.01 dominates it"
    return eps, None


@lru_cache(maxsize=4096)
def _answer(sigma: float, sample_rate: float, steps: int, delta: float,
            accountant: str) -> tuple[float, str | None, str]:
    """``(epsilon, note, answered_by)`` on validated arguments (the rules of the module docstring); ``note`` is None
    where ``accountant`` itself answered a finite epsilon; ``answered_by``: the accountant whose epsilon it is
    (``pld`` or ``rdp`` where it answers for ``prv``).  Memoised."""
    if steps == 0:
        return 0.0, None, accountant
    with _opacus_quiet():  # also around grid_points' RDP bound
        try:
            return _rules(sigma, sample_rate, steps, delta, accountant)
        except RuntimeError as e:  # PRV's and PLD's "Cannot compute epsilon": delta above the delta at epsilon 0
            raise vacuous_delta_error(delta, accountant, str(e)) from e


def _rules(sigma: float, sample_rate: float, steps: int, delta: float,
           accountant: str) -> tuple[float, str | None, str]:
    """:func:`_answer`'s rules: ``inf`` where the lower bound exceeds :data:`MAX_EPSILON`; the smaller of PLD and RDP
    where PRV cannot answer; else ``accountant`` itself."""
    above = f"above {MAX_EPSILON:g}, where a guarantee certifies nothing and the accountants are not trusted"
    bound = epsilon_lower_bound(sigma, sample_rate, steps, delta)
    if bound > MAX_EPSILON:
        return math.inf, f"epsilon is at least {bound:.4g} (a distinguishing test's lower bound), {above}", accountant
    why, note = None, None
    if accountant == "prv":
        eps, why = _prv(sigma, sample_rate, steps, delta)
    if why is not None:  # PLD and RDP are both upper bounds: the smaller one is (PLD's rounding grows with steps)
        fallback = {a: _run(a, sigma, sample_rate, steps, delta) for a in FALLBACK}
        accountant = min(FALLBACK, key=fallback.__getitem__)
        eps = fallback[accountant]
        note = f"answered by the {accountant} accountant (the smaller of the pld and rdp upper bounds): {why}"
    elif accountant != "prv":
        eps = _run(accountant, sigma, sample_rate, steps, delta)
    if math.isinf(eps):
        note = f"{note}; its epsilon is {above}" if note else f"the {accountant} accountant's epsilon is {above}"
    return eps, note, accountant


def _epsilon(sigma: float, sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    """:func:`epsilon` on validated arguments."""
    return _answer(sigma, sample_rate, steps, delta, accountant)[0]


def epsilon(sigma: float, sample_rate: float, steps: int, delta: float, accountant: str = "prv") -> float:
    """Epsilon spent by ``steps`` Poisson-subsampled Gaussian steps (noise multiplier ``sigma``, rate ``q``).

    Uses Opacus' ``PRVAccountant`` (an upper bound: estimate + ``eps_error`` = 0.01) or ``RDPAccountant`` with
    their default settings, or dp-accounting's PLD (``"pld"``). Results are memoised per argument tuple, so repeated
    calls are free.  Above :data:`MAX_EPSILON` the result is ``inf`` (no meaningful guarantee).  A ``delta`` at or
    above :func:`vacuous_delta_bound` raises ``ValueError`` (epsilon 0 holds at any sigma) before any accountant call.
    Where PRV cannot answer fast or accurately the smaller of PLD's and RDP's upper bounds answers instead:
    :func:`accounting_note` says when, which and why.
    """
    args = (_check_positive("sigma", sigma), _check_sample_rate(sample_rate), _check_steps("steps", steps),
            _check_delta(delta), _check_accountant(accountant))
    _check_not_vacuous(args[3], args[1], args[2], args[4])
    return _epsilon(*args)


# ----------------------------------------------------------------------------------------------- calibration


def accounting_note(sigma: float, sample_rate: float, steps: int, delta: float, accountant: str = "prv") -> str | None:
    """Why :func:`epsilon` with these arguments is not simply ``accountant``'s finite epsilon: another accountant
    answered (and why), or the answer is ``inf`` (and why); None otherwise.  Free after the :func:`epsilon` call."""
    epsilon(sigma, sample_rate, steps, delta, accountant)
    return _answer(float(sigma), float(sample_rate), int(steps), float(delta), accountant)[1]


def calibrate_sigma(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "prv"
) -> float:
    """Smallest noise multiplier with ``epsilon(sigma, sample_rate, steps, delta) <= target_epsilon``.

    Calibrate for the exact number of steps that will run. The result never overshoots the target (every sigma
    the search may return has been checked with :func:`epsilon`) and is tight: its epsilon lies within 0.5% below
    the target. Raises ``ValueError`` if even ``MAX_SIGMA`` cannot meet the target (each accountant has an
    epsilon floor, see the module docstring). A few to ~10 accountant calls: ~0.1-0.5 s each for PRV.
    """
    target = _check_positive("target_epsilon", target_epsilon)
    delta, q, accountant = _check_delta(delta), _check_sample_rate(sample_rate), _check_accountant(accountant)
    if target > MAX_EPSILON:
        raise ValueError(
            f"target_epsilon={target:g} is above {MAX_EPSILON:g}: a guarantee that weak certifies nothing, and the "
            "accountants are not accurate there (PRV overflows, calibration takes minutes). Choose an epsilon of at "
            f"most {MAX_EPSILON:g} (typical: 1-10), or train without privacy (--no-dp)."
        )
    if _check_steps("steps", steps) == 0:
        raise ValueError("steps must be >= 1 to calibrate sigma (zero steps spend no privacy at any sigma)")
    _check_not_vacuous(delta, q, steps, accountant)  # else every sigma meets the target and the search runs to
    # MIN_SIGMA, where the PLD accountant's grid is widest

    def eps(sigma: float) -> float:
        return _epsilon(sigma, q, steps, delta, accountant)

    # 1. Bracket by factors of 2 from sigma = 1: eps(lo) > target >= eps(hi).
    hi = 1.0
    while eps(hi) > target:  # grow until the target is met
        if hi >= MAX_SIGMA:
            _, note, used = _answer(hi, q, steps, delta, accountant)  # PLD or RDP may have answered for PRV: name it
            raise ValueError(
                f"target_epsilon={target} is unreachable with the {used!r} accountant at delta={delta}, "
                f"q={q}, steps={steps}: even sigma={hi:g} gives epsilon={eps(hi):.4g}"
                + (f" ({note})" if used != accountant else "")
                + ". Raise target_epsilon, or lower the sample rate or the number of steps."
            )
        hi = min(2 * hi, MAX_SIGMA)
    lo = hi / 2
    while eps(lo) <= target:  # shrink until it is not (after growing, lo is already known to miss it)
        if lo / 2 < MIN_SIGMA:
            return lo  # the target is so loose that the search floor already meets it
        lo, hi = lo / 2, lo

    # 2. Shrink the bracket. eps is close to a power law in sigma, so interpolate in log-log coordinates, aiming
    #    just below the target; clamping into the inner 80% of the bracket guarantees progress.
    tol = CALIBRATION_REL_TOL * target
    aim = math.log(target - tol / 2)
    for _ in range(100):
        if target - eps(hi) <= tol or hi / lo < 1 + 1e-9:
            break
        a, b = math.log(lo), math.log(hi)
        fa, fb = math.log(eps(lo)), math.log(max(eps(hi), 1e-300))
        t = (fa - aim) / (fa - fb) if math.isfinite(fa) and fa != fb else 0.5
        mid = math.exp(a + min(max(t, 0.1), 0.9) * (b - a))
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid

    # 3. The guarantee: verify the returned sigma with the accountant itself.
    while eps(hi) > target:
        hi *= 1.001
    return hi


# ----------------------------------------------------------------------------------------------- budget


def report_steps(total: int, points: int = 8) -> set[int]:
    """The steps at which a run of ``total`` steps shows its spent epsilon: ``points`` evenly spaced ones, the last
    included (each costs one accountant call; its time: docs/performance.md)."""
    total = _check_steps("total", total)
    return {math.ceil(total * i / points) for i in range(1, points + 1)} - {0}


@lru_cache(maxsize=256)
def _max_steps(sigma: float, sample_rate: float, delta: float, accountant: str, target: float) -> int:
    """Largest T <= MAX_STEPS with epsilon(T) <= target; epsilon grows with T."""
    within = lambda steps: _epsilon(sigma, sample_rate, steps, delta, accountant) <= target  # noqa: E731
    lo, hi = 0, 1  # invariant: within(lo) (zero steps spend nothing); after the doubling, not within(hi)
    while within(hi):
        if hi == MAX_STEPS:
            return MAX_STEPS
        lo, hi = hi, min(2 * hi, MAX_STEPS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo


class BudgetExhaustedError(RuntimeError):
    """Raised before a step that would push the spent epsilon past the target."""


class PrivacyBudget:
    """Tracks the epsilon spent by a run of identical Poisson-subsampled Gaussian steps.

    Use :meth:`spend` (or :meth:`check_step` then :meth:`record_step`) once per noisy release. With a
    ``target_epsilon`` a step that would exceed it raises :class:`BudgetExhaustedError` before anything is
    recorded. The whole run uses one ``(noise_multiplier, sample_rate)``; resume from :meth:`state_dict`.
    """

    def __init__(
        self,
        noise_multiplier: float,
        sample_rate: float,
        delta: float,
        target_epsilon: float | None = None,
        accountant: str = "prv",
        steps_taken: int = 0,
    ) -> None:
        self.noise_multiplier = _check_positive("noise_multiplier", noise_multiplier)
        self.sample_rate = _check_sample_rate(sample_rate)
        self.delta = _check_delta(delta)
        self.target_epsilon = None if target_epsilon is None else _check_positive("target_epsilon", target_epsilon)
        self.accountant = _check_accountant(accountant)
        self.steps_taken = _check_steps("steps_taken", steps_taken)
        self._verified = 0  # every step count up to this one is known to stay within the target

    def _epsilon_at(self, steps: int) -> float:
        return _epsilon(self.noise_multiplier, self.sample_rate, steps, self.delta, self.accountant)

    @property
    def epsilon(self) -> float:
        """Epsilon spent by the steps recorded so far.

        Memoised per step count, but a new count costs one accountant call (PRV: ~0.3 s at 2000 steps, RDP:
        ~0.05 s), so log it every few steps rather than every step. :meth:`check_step` does not call it.
        """
        return self._epsilon_at(self.steps_taken)

    @property
    def steps_allowed(self) -> int | None:
        """Largest total number of steps whose epsilon stays within the target (None without a target).

        Found once (memoised) by a doubling-then-bisection search over the step count, capped at ``MAX_STEPS``.
        """
        if self.target_epsilon is None:
            return None
        return _max_steps(self.noise_multiplier, self.sample_rate, self.delta, self.accountant, self.target_epsilon)

    def check_step(self, n: int = 1) -> None:
        """Raise :class:`BudgetExhaustedError` if ``n`` more steps would exceed the target. Records nothing.

        One accountant call (memoised) the first time a step count beyond the verified one is checked, none after:
        checking a whole run up front (``check_step(steps)``, as ``make_private`` does) makes every later per-step
        check free.
        """
        n = _check_steps("n", n)
        total = self.steps_taken + n
        if self.target_epsilon is None or total <= self._verified:
            return
        if self._epsilon_at(total) <= self.target_epsilon:
            self._verified = total
            return
        allowed = self.steps_allowed
        if total > allowed:
            raise BudgetExhaustedError(
                f"privacy budget exhausted: {n} more step(s) would raise epsilon from {self.epsilon:.4f} "
                f"(after {self.steps_taken} steps) to {self._epsilon_at(self.steps_taken + n):.4f}, above the "
                f"target epsilon={self.target_epsilon:g} at delta={self.delta:g} (sigma={self.noise_multiplier:.4g}, "
                f"q={self.sample_rate:.4g}, {self.accountant} accountant). The target allows {allowed} steps in "
                "total: train for fewer steps, or raise target_epsilon (and recalibrate sigma for the exact "
                "number of steps)."
            )

    def record_step(self, n: int = 1) -> None:
        """Record ``n`` steps as spent (no check)."""
        self.steps_taken += _check_steps("n", n)

    def spend(self, n: int = 1) -> None:
        """:meth:`check_step` then :meth:`record_step`."""
        self.check_step(n)
        self.record_step(n)

    def report(self) -> dict[str, Any]:
        """Plain summary for logs and result files; ``accountant_note`` (only where there is one): which accountant
        answered instead of ``accountant`` and why, or why the epsilon is ``inf`` (:func:`accounting_note`)."""
        note = _answer(self.noise_multiplier, self.sample_rate, self.steps_taken, self.delta, self.accountant)[1]
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps_taken,
            "accountant": self.accountant,
            "target_epsilon": self.target_epsilon,
        } | ({"accountant_note": note} if note else {})

    _MECHANISM = ("noise_multiplier", "sample_rate")

    def state_dict(self) -> dict[str, Any]:
        """Configuration and steps taken, for checkpoints."""
        keys = ("noise_multiplier", "sample_rate", "delta", "target_epsilon", "accountant", "steps_taken")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``steps_taken`` from a checkpoint of a run with the same mechanism.

        The recorded steps were taken with the checkpoint's ``noise_multiplier`` and ``sample_rate``; a budget
        with different values would misaccount them, so a mismatch raises ``ValueError``. ``delta``,
        ``target_epsilon`` and ``accountant`` are this budget's own (they only change how the steps are judged).
        """
        mismatched = [f"{k}={state.get(k)!r} in the checkpoint but {getattr(self, k)!r} here"
                      for k in self._MECHANISM if state.get(k) != getattr(self, k)]
        if mismatched:
            raise ValueError("privacy budget checkpoint was recorded with a different mechanism: "
                             + ", ".join(mismatched))
        self.steps_taken = _check_steps("steps_taken", state.get("steps_taken"))
