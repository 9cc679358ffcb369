"""Several processes, one private training run (``torch.distributed``: gloo on CPUs, NCCL on GPUs; ``torchrun``).

The run stays the one-process mechanism, split by examples:

* sampling: the global Poisson sample of rate q over all N examples. Rank r owns the examples ``r, r + W, ...`` and
  draws their inclusion from its own stream (seeded from the run's root seed and r, so the ranks' draws are
  independent); the expected batch is q N and the accountant uses q, as in one process.
* clipping is per example, on the rank that holds it; the clipped sums (and the clipping statistics) are all-reduced
  (SUM) once per logical step, through the mechanism's ``reduce`` hook;
* noise: every rank draws the same Gaussian from one shared stream (seeded identically on every rank; unseeded runs
  get rank 0's OS-drawn seed, broadcast; ``--secure-noise`` runs rank 0's OS-drawn ChaCha20 key, broadcast once) and
  adds it to the same global sum: the release carries one noise draw, not W.
  Every rank then runs the same optimizer step on the same release, so PRISM's frames, retraction and Adam state stay
  identical; :meth:`World.check_replicas` verifies it (a checksum of the trained tensors) and fails loudly otherwise.
* no DDP: gradients the mechanism discards are never all-reduced.

A failed collective (a process died, a connection dropped) raises :class:`PeerLostError` naming the step, instead of
hanging until a timeout.  When a rank dies, torchrun sends SIGTERM to the others; a survivor takes it as a request
(:func:`prismdp.train.interrupt.guard_termination`: never a silent death mid-error), meets the lost peer at its next
collective and ends with the lost-peer error, without tearing down the broken process group (which can block);
a survivor stuck in C++ that cannot reach it is ended by the guard's watchdog thread, 20 s after the SIGTERM.
Under NCCL a lost peer may not fail a collective at all: the process group's timeout (``PRISMDP_DIST_TIMEOUT``
seconds, default 300) bounds the wait, and NCCL's asynchronous error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``
unless set: abort the communicator, then end the process) ends every survivor within it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["World", "PeerLostError", "ReplicaDivergenceError", "current_world", "init_from_env", "shard_seed",
           "peer_lost"]

DEFAULT_TIMEOUT_S = 300.0  # a lost peer under NCCL ends the survivors within this (PRISMDP_DIST_TIMEOUT overrides)
_state = {"peer_lost": False}


def peer_lost() -> bool:
    """Whether a collective of this process has failed because another process of the run was lost."""
    return _state["peer_lost"]


class PeerLostError(RuntimeError):
    """A collective operation failed: another process of the run stopped or lost its connection."""


class ReplicaDivergenceError(RuntimeError):
    """The processes' copies of the trained tensors differ (they must stay identical)."""


def shard_seed(root: int, rank: int) -> int:
    """The seed of rank ``rank``'s sampling stream: distinct, independent streams derived from one root seed."""
    import numpy as np

    return int(np.random.SeedSequence([int(root) % 2**63, int(rank)]).generate_state(1, np.uint64)[0] >> 1)


class World:
    """The process group of a run: rank, size and the few collectives the mechanism and the trainer need."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else \
            torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def _lost(self, what: str, e: BaseException) -> PeerLostError:
        _state["peer_lost"] = True
        return PeerLostError(
            f"rank {self.rank} of {self.size}: the collective '{what}' failed ({type(e).__name__}: {e}). Another "
            "process of the run stopped or lost its connection; this run cannot continue. Resume it from its last "
            "checkpoint with the same number of processes.")

    def _run(self, what: str, fn):
        try:
            return fn()
        except (RuntimeError, ValueError, OSError) as e:  # gloo/NCCL report a lost peer as RuntimeError subclasses
            raise self._lost(what, e) from e

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Run code whose collectives are not ours (FSDP's all-gathers inside a forward or backward): a failure of
        the process group there becomes :class:`PeerLostError` like one of ours; any other error passes unchanged."""
        try:
            yield
        except RuntimeError as e:
            if not _lost_peer(e):
                raise
            raise self._lost(what, e) from e

    def all_reduce_sum(self, tensors: Sequence[Tensor], what: str = "sum") -> None:
        """In-place SUM across ranks; tensors are grouped by dtype into one flat buffer each (one collective per
        dtype), on the process group's device."""
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.reshape(-1).to(self.device) for t in ts])
            self._run(what, lambda: self.dist.all_reduce(flat, group=self.group))
            offset = 0
            for t in ts:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n

    def all_reduce_max(self, value: int, what: str = "max") -> int:
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        self._run(what, lambda: self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group))
        return int(t.item())

    def queue_max(self, value: int, what: str = "max") -> Tensor:
        """The MAX of ``value`` across ranks as a one-element tensor on the process group's device, without reading
        it: read it with the step's other numbers (:class:`prismdp.engine.StepReport`'s ``flags``).  On NCCL the
        all-reduce is queued on the stream; gloo runs it at once."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        self._run(what, lambda: self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group))
        return t

    def broadcast_int(self, value: int | None, what: str = "broadcast") -> int:
        """Rank 0's ``value`` on every rank (rank 0 must pass one)."""
        t = torch.tensor([int(value) if self.main else 0], dtype=torch.int64, device=self.device)
        self._run(what, lambda: self.dist.broadcast(t, src=0, group=self.group))
        return int(t.item())

    def gather_objects(self, obj: Any, what: str = "gather") -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        out = [None] * self.size
        self._run(what, lambda: self.dist.all_gather_object(out, obj, group=self.group))
        return out

    def barrier(self, what: str = "barrier") -> None:
        self._run(what, lambda: self.dist.barrier(group=self.group))

    def check_replicas(self, tensors: Sequence[Tensor], step: int) -> None:
        """Raise :class:`ReplicaDivergenceError` unless every rank holds the same ``tensors`` (float64 checksums: the
        sum and the sum of squares, compared exactly across ranks)."""
        with torch.no_grad():
            acc = torch.zeros(2, dtype=torch.float64, device=self.device)
            for t in tensors:
                t64 = t.detach().to(self.device, torch.float64)
                acc[0] += t64.sum()
                acc[1] += t64.square().sum()
        lo, hi = acc.clone(), acc.clone()
        self._run("replica checksum", lambda: self.dist.all_reduce(lo, op=self.dist.ReduceOp.MIN, group=self.group))
        self._run("replica checksum", lambda: self.dist.all_reduce(hi, op=self.dist.ReduceOp.MAX, group=self.group))
        if not torch.equal(lo, hi):
            raise ReplicaDivergenceError(
                f"after step {step} the processes' trained tensors differ (checksums from {lo.tolist()} to "
                f"{hi.tolist()}); every rank must apply the same release. Check that all ranks run the same code, "
                "model, seed and settings.")

    def shared_key(self, nbytes: int = 32) -> bytes:
        """Rank 0's ``nbytes`` fresh OS-random bytes on every rank (the shared key of ``--secure-noise``'s noise
        stream: one broadcast at the start, no per-step communication)."""
        box = [secrets.token_bytes(nbytes) if self.main else None]
        self._run("shared noise key", lambda: self.dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def shared_seed(self, seed: int | None) -> int:
        """One seed for every rank: ``seed`` if given (it must be the same everywhere), else rank 0's OS entropy."""
        chosen = self.broadcast_int(seed if seed is not None else secrets.randbits(62) if self.main else None,
                                    "shared seed")
        if seed is not None and chosen != seed:
            raise ValueError(f"rank {self.rank} was given seed {seed} but rank 0 has {chosen}; give every process "
                             "the same seed")
        return chosen


_PEER_SIGNS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe")


def _lost_peer(e: BaseException) -> bool:
    """Whether ``e`` comes from the process group (a backend error, or gloo's plain RuntimeError naming itself)."""
    import torch.distributed as dist

    return isinstance(e, getattr(dist, "DistError", ())) or any(s in str(e).lower() for s in _PEER_SIGNS)


def current_world() -> World | None:
    """The default process group as a :class:`World` if one with more than one process is initialised, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return World()
    return None


def dist_timeout_s() -> float:
    """The process group's timeout: ``PRISMDP_DIST_TIMEOUT`` seconds if set (a positive number), else
    :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get("PRISMDP_DIST_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"PRISMDP_DIST_TIMEOUT={raw!r}: give the seconds a collective may wait for a lost peer, a "
                         f"positive number (default {DEFAULT_TIMEOUT_S:g})")
    return value


def init_from_env(timeout_s: float | None = None) -> World | None:
    """Initialise the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``PORT``): NCCL with one GPU per process (``cuda:LOCAL_RANK``) when CUDA is available, else gloo,
    with the timeout ``timeout_s`` (default :func:`dist_timeout_s`) and NCCL's asynchronous error handling on.
    Returns None outside torchrun or for a single process."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if not dist.is_initialized():
        timeout_s = dist_timeout_s() if timeout_s is None else timeout_s
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # read when the NCCL process group is made: abort the communicator and end the process on a collective's
            # error or timeout (torch's default, 3, ends it without aborting; 0 would hang)
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        atexit.register(_destroy_group)  # we created it, we close it (an open group can abort at interpreter exit)
    return current_world()


def _destroy_group() -> None:
    import gc

    import torch.distributed as dist

    if dist.is_initialized() and not _state["peer_lost"]:  # a broken group's teardown can block: leave it to exit
        gc.collect()  # free unreachable modules (FSDP state, DTensors) while their group is alive, not after it
        dist.destroy_process_group()
