"""The privacy of hyperparameter tuning by random search with a random number of trials: pure math, no LoRA.

Papernot and Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR 2022): run a private mechanism
``Q`` (one training run plus its validation score) ``K`` times with independently drawn hyperparameters, ``K`` itself
random, and release only the best run.  If ``K`` follows a truncated negative binomial distribution (their
Theorem 2; shape ``eta = 1`` is the geometric, ``eta = 0`` the logarithmic distribution) or a Poisson distribution
(their Theorem 6), the whole procedure's Renyi DP is the trial's RDP curve plus a term that grows only with the log
of the mean number of trials: a constant factor on epsilon, not the ``K``-fold composition.  A *fixed* ``K`` has no
such bound (releasing the best of ``K`` runs can cost ``K`` times one run).

The accounting is Google's ``dp_accounting``: its ``RdpAccountant`` implements both theorems for
``RepeatAndSelectDpEvent`` and converts RDP to (epsilon, delta).  The trial is ``steps`` Poisson-subsampled Gaussian
steps (noise multiplier ``sigma``, rate ``q``) composed with one Gaussian release of the validation score (noise
multiplier ``score_sigma`` on a count of sensitivity 1), so one example's influence is bounded whether it sits in the
training set or in the validation split.

A fixed ``K`` (``fixed:K``, e.g. a grid that tries every candidate once) is accounted by composition instead: ``K``
trials composed (``K * steps`` subsampled Gaussian steps and ``K`` score releases) by one of prismdp's accountants
(PRV by default), an upper bound on releasing the best of them.  For a few short runs this is the cheaper of the two
(PRV composition is tight where the RDP route of the theorems is not; docs/tuning.md has numbers).

- :class:`TrialCount` -- the distribution of ``K``: parse ``poisson:MEAN``, ``geometric:MEAN``,
  ``negative-binomial:SHAPE:MEAN``, ``logarithmic:MEAN`` or ``fixed:K``; its parameters and a draw.
- :func:`tuning_epsilon` / :func:`trial_epsilon` -- epsilon of the whole procedure / of one trial.
- :func:`calibrate_tuning_sigma` -- the smallest per-trial noise multiplier whose whole procedure meets a target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Optional

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from .accounting import MAX_STEPS, history_epsilon

__all__ = ["FAMILIES", "TrialCount", "tnb_mean", "trial_accountant", "trial_epsilon", "tuning_epsilon",
           "calibrate_tuning_sigma"]

FAMILIES = ("poisson", "geometric", "negative-binomial", "logarithmic", "fixed")
_FORMS = ("poisson:MEAN, geometric:MEAN, negative-binomial:SHAPE:MEAN, logarithmic:MEAN (e.g. geometric:8) or "
          "fixed:K (K trials, accounted by composition)")
_SHAPES = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0, "fixed": None}


def tnb_mean(gamma: float, eta: float) -> float:
    """Mean of the truncated negative binomial ``D_{eta, gamma}`` (the paper's Definition 1):
    ``eta (1 - gamma) / (gamma (1 - gamma^eta))``; ``eta = 0`` (logarithmic): ``(1/gamma - 1) / log(1/gamma)``."""
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


def _tnb_gamma(mean: float, eta: float) -> float:
    """The ``gamma`` in (0, 1) whose :func:`tnb_mean` is ``mean`` (> 1): bisection in log gamma (the mean falls as
    gamma grows)."""
    if eta == 1:
        return 1 / mean
    lo, hi = math.log(1e-300), math.log(1 - 1e-15)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tnb_mean(math.exp(mid), eta) > mean else (lo, mid)
    return math.exp((lo + hi) / 2)


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials ``K``.  ``family``: one of :data:`FAMILIES`; ``mean``: E[K];
    ``shape``: eta of the negative binomial (geometric 1, logarithmic 0, Poisson infinity: dp_accounting's ``shape``;
    None for ``fixed``).  The truncated families never draw 0; the Poisson draws 0 with probability exp(-mean) (then
    nothing is released); ``fixed`` always draws ``mean``."""

    family: str
    mean: float
    shape: Optional[float]

    @property
    def random(self) -> bool:
        """K is random (the paper's theorems apply); False for ``fixed`` (composition)."""
        return self.family != "fixed"

    @classmethod
    def parse(cls, text: str) -> "TrialCount":
        parts = str(text).strip().split(":")
        family, nums = parts[0], parts[1:]
        arity = {"negative-binomial": 2}.get(family, 1)
        if family not in FAMILIES or len(nums) != arity:
            raise ValueError(f"--trials {text!r}: expected {_FORMS}")
        try:
            values = [float(v) for v in nums]
        except ValueError:
            raise ValueError(f"--trials {text!r}: not a number; expected {_FORMS}") from None
        return cls.of(family, values[-1], values[0] if family == "negative-binomial" else None)

    @classmethod
    def of(cls, family: str, mean: float, shape: float | None = None) -> "TrialCount":
        """Validated: a Poisson mean > 0; a truncated family's mean > 1 (mean 1 is a single run) and shape > 0 for
        the negative binomial (shape 0 is the logarithmic family, 1 the geometric)."""
        if family not in FAMILIES:
            raise ValueError(f"trial count family must be one of {', '.join(FAMILIES)}, got {family!r}")
        shape = _SHAPES.get(family, shape)
        if family == "fixed":
            if not (isinstance(mean, (int, float)) and 1 <= mean <= MAX_STEPS and int(mean) == mean):
                raise ValueError(f"fixed:K: K must be a whole number of trials in [1, {MAX_STEPS:,}], got {mean!r}")
            return cls(family, float(mean), None)
        if not (isinstance(mean, (int, float)) and math.isfinite(mean)) or mean <= (0 if family == "poisson" else 1):
            low = "> 0" if family == "poisson" else "> 1 (a mean of 1 is a single run: use prismdp train)"
            raise ValueError(f"the mean number of trials must be {low}, got {mean!r}")
        if family == "negative-binomial" and not (shape is not None and 0 < shape < math.inf):
            raise ValueError(f"negative-binomial: the shape must be a number > 0 (0 is logarithmic:MEAN, 1 is "
                             f"geometric:MEAN), got {shape!r}")
        return cls(family, float(mean), float(shape))

    @cached_property
    def gamma(self) -> float | None:
        """The truncated families' parameter gamma (success probability); None for the Poisson."""
        return None if self.family in ("poisson", "fixed") else _tnb_gamma(self.mean, self.shape)

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of K from ``rng`` (a truncated family: a negative binomial draw conditioned on K >= 1)."""
        if self.family == "fixed":
            return int(self.mean)
        if self.family == "poisson":
            return int(rng.poisson(self.mean))
        if self.family == "logarithmic":
            return int(rng.logseries(1 - self.gamma))
        while True:  # numpy's negative_binomial(eta, gamma): P[k] proportional to C(k+eta-1, k) gamma^eta (1-gamma)^k
            k = int(rng.negative_binomial(self.shape, self.gamma))
            if k > 0:
                return k

    def describe(self) -> dict[str, Any]:
        """The distribution for a report: family, parameters, mean (and P[K = 0] for the Poisson)."""
        out: dict[str, Any] = {"family": self.family, "mean": self.mean}
        if self.family == "fixed":
            out["accounted_by"] = "composition of the K trials"
        elif self.family == "poisson":
            out["p_zero"] = math.exp(-self.mean)
        else:
            out.update(shape_eta=self.shape, gamma=self.gamma)
        return out

    def __str__(self) -> str:
        shape = f"{self.shape:g}:" if self.family == "negative-binomial" else ""
        if self.family == "fixed":
            return f"fixed:{int(self.mean)}"
        return f"{self.family}:{shape}{self.mean:g}"


def _trial_event(sigma: float, q: float, steps: int, score_sigma: float | None) -> dp_event.DpEvent:
    train = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    if score_sigma is None:
        return train
    return dp_event.ComposedDpEvent([train, dp_event.GaussianDpEvent(score_sigma)])


def _check(sigma: float, q: float, steps: int, delta: float, score_sigma: float | None) -> None:
    if not sigma > 0 or not 0 < q <= 1 or not (isinstance(steps, int) and steps >= 1) or not 0 < delta < 1:
        raise ValueError(f"need sigma > 0, q in (0, 1], steps >= 1, delta in (0, 1); got sigma={sigma!r}, q={q!r}, "
                         f"steps={steps!r}, delta={delta!r}")
    if score_sigma is not None and not score_sigma > 0:
        raise ValueError(f"score_sigma must be > 0 (or None: the score is not released), got {score_sigma!r}")


def _composed(sigma: float, q: float, steps: int, delta: float, score_sigma: float | None, k: int,
              accountant: str) -> float:
    """``k`` trials composed, by one of prismdp's accountants (:data:`.accounting.ACCOUNTANTS`, their history of
    ``(sigma, q, steps)`` entries: the score's release is a Gaussian with q = 1); ``k * steps`` above
    :data:`.accounting.MAX_STEPS` is refused, as for one run."""
    if k * steps > MAX_STEPS:
        raise ValueError(f"{k} trials of {steps} steps compose {k * steps} steps, above {MAX_STEPS:,} (beyond the "
                         "accountants' tested range): fewer trials or steps, or a random count (e.g. geometric:8)")
    return history_epsilon(accountant, [(sigma, q, k * steps)] + ([(score_sigma, 1.0, k)] if score_sigma is not None
                                                                   else []), delta)


def trial_accountant(count: TrialCount, accountant: str = "prv") -> str:
    """The accountant of the whole tuning: ``rdp`` (dp_accounting) for a random count (the theorems are in RDP), the
    given one (prismdp's PRV by default) for a fixed count's composition."""
    return "rdp" if count.random else accountant


@lru_cache(maxsize=1024)
def trial_epsilon(sigma: float, q: float, steps: int, delta: float, score_sigma: float | None = None,
                  accountant: str = "rdp") -> float:
    """Epsilon of one trial at ``delta``: ``steps`` Poisson-subsampled Gaussian steps plus the score's Gaussian
    release, by dp_accounting's RDP accountant (its default orders; ``rdp``, what :func:`tuning_epsilon` uses for a
    random count) or one of prismdp's accountants (``prv``, ``pld``; Opacus' ``rdp`` is not offered here)."""
    _check(sigma, q, steps, delta, score_sigma)
    if accountant != "rdp":
        return _composed(sigma, q, steps, delta, score_sigma, 1, accountant)
    acc = rdp.RdpAccountant()
    acc.compose(_trial_event(sigma, q, steps, score_sigma))
    return float(acc.get_epsilon(delta))


@lru_cache(maxsize=1024)
def tuning_epsilon(sigma: float, q: float, steps: int, delta: float, count: TrialCount,
                   score_sigma: float | None = None, accountant: str = "prv") -> float:
    """Epsilon at ``delta`` of releasing the best of ``K ~ count`` trials (each as in :func:`trial_epsilon`).

    A random count: dp_accounting's ``RepeatAndSelectDpEvent`` (the paper's Theorem 2, or Theorem 6 for the Poisson)
    then its RDP to (epsilon, delta) conversion (``accountant`` is not used).  A fixed count: the ``K`` trials
    composed by ``accountant`` (prismdp's ``prv``, ``rdp`` or ``pld``)."""
    _check(sigma, q, steps, delta, score_sigma)
    if not count.random:
        return _composed(sigma, q, steps, delta, score_sigma, int(count.mean), accountant)
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.RepeatAndSelectDpEvent(_trial_event(sigma, q, steps, score_sigma), count.mean, count.shape))
    return float(acc.get_epsilon(delta))


def calibrate_tuning_sigma(target_epsilon: float, delta: float, q: float, steps: int, count: TrialCount,
                           score_sigma: float | None = None, rel_tol: float = 0.005, accountant: str = "prv") -> float:
    """Smallest per-trial noise multiplier whose whole tuning meets ``target_epsilon`` (:func:`tuning_epsilon` at or
    below it, within ``rel_tol`` of it).  Raises ``ValueError`` if the score's release alone, or the paper's bound's
    ``log(mean)`` term, already exceeds the target at any noise (``sigma`` up to 1e4)."""
    if not target_epsilon > 0:
        raise ValueError(f"target epsilon must be > 0, got {target_epsilon!r}")

    def eps(s: float) -> float:
        return tuning_epsilon(s, q, steps, delta, count, score_sigma, accountant)

    hi = 1.0
    while eps(hi) > target_epsilon:
        if hi >= 1e4:
            floor = "the score's release and " if score_sigma is not None else ""
            raise ValueError(
                f"total epsilon {target_epsilon:g} is out of reach for {count} trials at delta {delta:g}: even noise "
                f"multiplier {hi:g} per trial gives {eps(hi):.3g} ({floor}the number of trials alone exceed it). "
                "Raise the epsilon, lower the (mean) number of trials"
                + (", or raise --score-noise" if score_sigma is not None else ""))
        hi *= 2
    lo = hi / 2
    while eps(lo) <= target_epsilon:
        if lo < 1e-2:
            return lo
        lo, hi = lo / 2, lo
    while target_epsilon - eps(hi) > rel_tol * target_epsilon and hi / lo > 1 + 1e-9:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi
