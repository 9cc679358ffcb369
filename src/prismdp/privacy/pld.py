"""Google's ``dp-accounting`` privacy-loss-distribution (PLD) accountant behind Opacus' accountant interface.

A second, independent implementation beside Opacus' PRV and RDP accountants (:mod:`prismdp.privacy.accounting`): the
same ``history`` of ``(noise_multiplier, sample_rate, steps)`` entries, composed as ``steps`` self-compositions of a
Poisson-subsampled Gaussian (add-or-remove-one neighbours, as Opacus) by ``dp_accounting.pld.PLDAccountant``.

Error: the PLD is discretised with a pessimistic rounding (``pessimistic_estimate=True``, dp-accounting's default), so
the epsilon is an upper bound at any grid interval; the rounding of each step's privacy loss to the grid can add at
most ``steps * interval`` to it.  The interval is ``VALUE_DISCRETIZATION = 1e-4`` (dp-accounting's default) unless one
step's privacy-loss range would need more than :data:`MAX_GRID_POINTS` points at that interval (small noise
multipliers: sigma below ~0.5 at q = 0.08); it is then widened to keep that many points.  dp-accounting builds the grid
in a Python loop, so without that cap a call at a small sigma takes minutes and gigabytes (docs/performance.md,
"Design choices measured"); tests/test_privacy.py checks it against Opacus' PRV estimate.

A delta at which epsilon 0 already holds (the hockey-stick divergence at epsilon 0, i.e. the total variation, is at
most delta) is refused with Opacus' PRV's ``RuntimeError("Cannot compute epsilon ...")``: dp-accounting returns
epsilon 0 there, a guarantee that says nothing (:func:`prismdp.privacy.accounting.vacuous_delta_error`).
"""

from __future__ import annotations

__all__ = ["PLDAccountant", "VALUE_DISCRETIZATION", "MAX_GRID_POINTS"]

VALUE_DISCRETIZATION = 1e-4
MAX_GRID_POINTS = 200_000  # per step and direction (dp-accounting builds the grid point by point)


def discretization(sigma: float, sample_rate: float) -> float:
    """The grid interval for one Poisson-subsampled Gaussian step: ``VALUE_DISCRETIZATION``, or wider so that its
    privacy-loss range (between dp-accounting's own tail truncation points, both neighbour directions) holds at most
    ``MAX_GRID_POINTS`` points."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    span = 0.0
    for adjacency in (plm.AdjacencyType.ADD, plm.AdjacencyType.REMOVE):
        loss = plm.GaussianPrivacyLoss(sigma, sensitivity=1, sampling_prob=sample_rate, adjacency_type=adjacency)
        tail = loss.privacy_loss_tail()
        span = max(span, abs(loss.privacy_loss(tail.lower_x_truncation) - loss.privacy_loss(tail.upper_x_truncation)))
    return max(VALUE_DISCRETIZATION, span / MAX_GRID_POINTS)


class PLDAccountant:
    """``history`` = list of ``(noise_multiplier, sample_rate, steps)``; :meth:`get_epsilon` composes it with PLDs."""

    def __init__(self) -> None:
        self.history: list[tuple[float, float, int]] = []

    def get_epsilon(self, delta: float) -> float:
        from dp_accounting import dp_event, pld

        interval = max([discretization(sigma, q) for sigma, q, _ in self.history], default=VALUE_DISCRETIZATION)
        acc = pld.PLDAccountant(value_discretization_interval=interval)
        for sigma, q, steps in self.history:
            acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), int(steps))
        eps = float(acc.get_epsilon(delta))
        if eps <= 0 and acc.get_delta(0.0) <= delta:
            raise RuntimeError(f"Cannot compute epsilon: delta={delta:g} is at least the delta at epsilon 0 "
                               f"({acc.get_delta(0.0):.4g})")
        return eps
