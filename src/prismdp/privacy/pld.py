"""Google's ``dp-accounting`` privacy-loss-distribution (PLD) accountant behind Opacus' accountant interface.

A second, independent implementation beside Opacus' PRV and RDP accountants (:mod:`prismdp.privacy.accounting`): the
same ``history`` of ``(noise_multiplier, sample_rate, steps)`` entries, composed as ``steps`` self-compositions of a
Poisson-subsampled Gaussian (add-or-remove-one neighbours, as Opacus) by ``dp_accounting.pld.PLDAccountant``.

Error: the PLD is discretised with a pessimistic rounding (``pessimistic_estimate=True``, dp-accounting's default), so
the epsilon is an upper bound; the rounding of each step's privacy loss to the grid (``VALUE_DISCRETIZATION = 1e-4``,
dp-accounting's default) can add at most ``steps * 1e-4`` to it.  Measured against Opacus' PRV estimate on the
grid of tests/test_privacy.py it is within 2e-4 of it (PRV's own stated error is 0.01 either side).
"""

from __future__ import annotations

__all__ = ["PLDAccountant", "VALUE_DISCRETIZATION"]

VALUE_DISCRETIZATION = 1e-4


class PLDAccountant:
    """``history`` = list of ``(noise_multiplier, sample_rate, steps)``; :meth:`get_epsilon` composes it with PLDs."""

    def __init__(self) -> None:
        self.history: list[tuple[float, float, int]] = []

    def get_epsilon(self, delta: float) -> float:
        from dp_accounting import dp_event, pld

        acc = pld.PLDAccountant(value_discretization_interval=VALUE_DISCRETIZATION)
        for sigma, q, steps in self.history:
            acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), int(steps))
        return float(acc.get_epsilon(delta))
