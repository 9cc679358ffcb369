"""How the micro-steps of one logical step run across the processes of a run, apart from the DP step itself.

Three protocols, chosen once when the engine is made (:func:`micro_step_protocol`, from the run's
:class:`~prismdp.distributed.World` and whether its frozen base is sharded: :attr:`prismdp.base.FrozenBase.lockstep`)
and owned by :class:`prismdp.engine.PrivateLoRA` (``private.processes``):

* :class:`OneProcess`: each micro-batch with examples runs once; nothing is reduced;
* :class:`Replicated`: several processes, each with the whole model.  No collective runs inside a micro-step, so the
  ranks need not agree on their number of micro-batches (a rank with an empty share runs none); the non-private
  gradient sum, the logged loss and the replica check are all-reduced once per step;
* :class:`Lockstep`: the frozen base is sharded (FSDP2), so every forward and backward is a collective: the ranks
  agree on the step's micro-step count (one all-reduce) and a rank with fewer micro-batches runs *idle* ones (a
  stand-in forward whose gradient is discarded); a failure of a peer inside FSDP's collectives becomes
  :class:`~prismdp.distributed.PeerLostError`.

The mechanism's own all-reduce of the clipped sums is not here: it is the mechanism's ``reduce`` hook.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["REPLICA_CHECK_EVERY", "OneProcess", "Replicated", "Lockstep", "micro_step_protocol"]

REPLICA_CHECK_EVERY = 10  # multi-process runs compare the ranks' trained tensors this often (and at checkpoints)

Micro = tuple[list[int], "list[int] | None"]  # (example indices, unit of each example or None)


class OneProcess:
    """One process: the micro-batches with examples run in order, nothing is reduced."""

    world = None
    lockstep = False

    def run(self, micros: Sequence[Micro], micro_step: Callable[[list[int], list[int] | None], None],
            idle_step: Callable[[], None]) -> None:
        """``micro_step(indices, groups)`` for every micro-batch with examples (``idle_step()``: see
        :class:`Lockstep`)."""
        for micro, groups in micros:
            if micro:
                micro_step(micro, groups)

    def sum(self, tensors: Sequence[Tensor], what: str) -> None:
        """Sum ``tensors`` in place over the processes (nothing to do in one)."""

    def sum_gradients(self, params: Sequence[Tensor], count: int) -> int:
        """A non-private step: ``params``' gradients summed over the processes, and the number of examples they
        hold; returns that number (here ``count``)."""
        return count

    def check_replicas(self, params: Sequence[Tensor], step: int, force: bool = False) -> None:
        """Every :data:`REPLICA_CHECK_EVERY` steps (or ``force``): fail unless every process holds the same
        ``params`` (nothing to compare in one process)."""


class Replicated(OneProcess):
    """Several processes, each holding the whole model (see the module docstring)."""

    def __init__(self, world):
        self.world = world

    def sum(self, tensors: Sequence[Tensor], what: str) -> None:
        self.world.all_reduce_sum(tensors, what)

    def sum_gradients(self, params: Sequence[Tensor], count: int) -> int:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        total = torch.tensor([float(count)], dtype=torch.float64)
        self.world.all_reduce_sum([p.grad for p in params] + [total], "non-private gradient mean")
        return int(total.item())

    def check_replicas(self, params: Sequence[Tensor], step: int, force: bool = False) -> None:
        if force or step % REPLICA_CHECK_EVERY == 0:
            self.world.check_replicas(params, step)


class Lockstep(Replicated):
    """Several processes around a sharded frozen base: every forward is a collective (see the module docstring)."""

    lockstep = True

    def run(self, micros: Sequence[Micro], micro_step: Callable[[list[int], list[int] | None], None],
            idle_step: Callable[[], None]) -> None:
        """Every rank runs the largest local count of micro-steps (one all-reduce and one host read per step): its
        micro-batches, then ``idle_step()`` for each one it lacks (an empty micro-batch too)."""
        agreed = self.world.all_reduce_max(len(micros), "micro-step count")
        for micro, groups in list(micros) + [([], None)] * (agreed - len(micros)):
            if micro:
                with self.world.collective("micro-step of the sharded model"):
                    micro_step(micro, groups)
            else:
                with self.world.collective("idle micro-step of the sharded model"):
                    idle_step()


def micro_step_protocol(world, lockstep: bool) -> OneProcess:
    """The protocol of a run: :class:`OneProcess` without a ``world``, :class:`Lockstep` for a sharded base (its
    forwards are collectives), else :class:`Replicated`."""
    if world is None:
        return OneProcess()
    return Lockstep(world) if lockstep else Replicated(world)
