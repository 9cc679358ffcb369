"""Step hooks: the seam through which diagnostics, audits and benchmarks observe an optimizer step.

``opt.attach_step_hook(fn)`` (as Opacus' ``DPOptimizer.attach_step_hook``) calls ``fn(record)`` at the end of every
``step()`` with a :class:`StepRecord`: what the mechanism released and with which noise, and (PRISM) the
preconditioners of the adaptive step.  Observers read the record; they never patch the optimizer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from torch import Tensor
from torch.utils.hooks import RemovableHandle

from ..privacy.mechanism import Release

__all__ = ["StepRecord", "StepHooks"]


@dataclass
class StepRecord:
    """One optimizer step.

    ``release``: the mechanism's :class:`~prismdp.privacy.mechanism.Release` (``None`` for a non-private step), in the
    optimizer's own coordinates: factor-space methods one tensor per trained parameter (``opt.params`` order);
    PRISM, per stack of equal-shape pairs, the lifts ``dA (k, m, r)`` and ``dB (k, n, r)`` of the pairs
    ``stacks[i]``, then one tensor per dense parameter.  ``preconditioners``: PRISM's adaptive step per stack,
    ``(P_A (k, r, r), w_A (k, r), P_B, w_B)`` (the matrices and their clamped eigenvalues); ``None`` otherwise.
    ``factors``: PRISM, per stack, the point ``(A (k, m, r), B (k, n, r))`` (intrinsic factors, ``Z = A B^T``) at which
    the release was computed, so that a lift ``(dA, dB)`` reads as the tangent vector ``dA B^T + A dB^T``; ``None``
    otherwise.
    """

    release: Release | None
    stacks: list[list[int]] | None = None
    preconditioners: list[tuple[Tensor, Tensor, Tensor, Tensor]] | None = None
    factors: list[tuple[Tensor, Tensor]] | None = None


class StepHooks:
    def __init__(self):
        self._fns: OrderedDict[int, Callable[[StepRecord], None]] = OrderedDict()

    def attach(self, fn: Callable[[StepRecord], None]) -> RemovableHandle:
        handle = RemovableHandle(self._fns)
        self._fns[handle.id] = fn
        return handle

    def __bool__(self) -> bool:
        return bool(self._fns)

    def __call__(self, record: StepRecord) -> None:
        for fn in list(self._fns.values()):
            fn(record)
