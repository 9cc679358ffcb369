"""Ctrl-C (SIGINT) and SIGTERM during training: finish the step under way, save a checkpoint, stop cleanly.

An interruption in the middle of a step would leave the optimizer half-way through an update and the data sampler
past a batch that was never released, so the signal only sets a flag; the training loop reads it after each step,
saves a checkpoint there and raises :class:`TrainingInterrupted` (a ``KeyboardInterrupt``: code that does not know
it, such as an experiment grid, stops as it would on Ctrl-C).  In a one-process run a second Ctrl-C stops at once.
In a multi-process run the ranks get the signal at different moments, or only some of them do (``torchrun`` starts
its workers in sessions of their own and forwards a Ctrl-C to each in turn; a scheduler may signal any process): the
ranks add their flags in the per-step all-reduce, so all of them stop after the same step, and later signals are
ignored (torchrun's shutdown timeout, 30 s by default, still applies: a step and a checkpoint must fit in it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator

__all__ = ["StopRequest", "TrainingInterrupted", "last_word", "guard_termination", "termination_requested"]

_taken: dict = {"name": None}  # a SIGTERM the guard took outside the training loop


def termination_requested() -> str | None:
    """The name of a SIGTERM/SIGINT that :func:`guard_termination` took outside the training loop (None if none)."""
    return _taken["name"]


STOP_GRACE_S = 20.0  # torchrun sends SIGKILL 30 s after its SIGTERM: a survivor must have said why and ended by then
_last_word = threading.RLock()  # a multi-process run's rank ends with one error line, printed under this lock
_said = threading.Event()  # ... and set once it is printed


@contextlib.contextmanager
def last_word() -> Iterator[None]:
    """Print the process's last error line inside this (the CLI does, on its way out): the SIGTERM watchdog then
    prints none of its own, and one it is printing is not interleaved with it."""
    with _last_word:
        yield
        _said.set()


def _dist_up() -> bool:
    dist = sys.modules.get("torch.distributed")  # (no import here: the signal may come mid-import)
    return dist is not None and dist.is_available() and dist.is_initialized()


def _rank() -> str:
    return f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}"


def _starting(name: str) -> str:
    return (f"prismdp: error: {_rank()}: {name} while the run was starting: another process of the run stopped or "
            "lost its connection (torchrun then stops them all; its error is above), or the run was cancelled. "
            "Nothing was trained: run the command again.")


def _end(line: str, signum: int, stacks: bool = False) -> None:
    with _last_word:
        if not _said.is_set():  # (else the main thread has printed its last line and is on its way out)
            print(line, file=sys.stderr, flush=True)
            if stacks:  # where the run was stuck: for a report
                import faulthandler

                print("prismdp: where each thread was when the watchdog ended the process:", file=sys.stderr,
                      flush=True)
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
        os._exit(128 + signum)


def _watch(fd: int, grace: float) -> None:
    """The watchdog thread: Python runs a signal handler only between bytecodes of the main thread, so a main thread
    blocked inside a C++ call (a collective or a store wait that never sees its peer die) would never run it, and
    torchrun's SIGKILL would end the process without a word.  The C-level handler writes each signal's number to
    ``fd`` (``signal.set_wakeup_fd``); on SIGTERM this thread ends the process itself: within half a second while
    the run is starting, else after ``grace`` seconds (time for the training loop to finish its step and save a
    checkpoint, or for the main thread to meet the lost peer and print the lost-peer error), with every thread's
    stack for a report."""
    while True:
        try:
            data = os.read(fd, 512)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM.value in data:
            break
    time.sleep(0.5)  # time for the main thread's handler to run, if the main thread is running Python
    if _taken["name"] is None and not _dist_up():  # (a handler that ran while the group was up recorded it)
        _end(_starting("SIGTERM"), signal.SIGTERM.value)
    time.sleep(grace)
    _end(f"prismdp: error: {_rank()}: SIGTERM {grace:g} s ago and the run has not stopped: another process of the "
         "run stopped or lost its connection (a collective is still waiting for it), or the run was cancelled. "
         "Resume from the run's last checkpoint with the same number of processes.", signal.SIGTERM.value, stacks=True)


def guard_termination(grace: float | None = None) -> None:
    """In a multi-process run, take SIGTERM (torchrun's, when another rank died; a scheduler's) as a request
    instead of a silent death, for the whole run (from the command's start: ``prismdp``'s CLI installs it under
    torchrun).  Before the process group is up there is nothing to save: the process says why in one line and
    exits (a dead peer would otherwise leave it waiting in the rendezvous until the timeout).  Afterwards the
    training loop's :class:`~prismdp.train.interrupt.StopRequest` replaces it while steps run (and starts from a
    request already taken), and outside the loop (loading, a lost-peer error on its way out, evaluation) the process
    goes on to its next collective, which either fails with the lost-peer error, printed, or proceeds.  Whatever the
    main thread is doing, a watchdog thread (:func:`_watch`) ends the process with one error line ``grace`` seconds
    (default :data:`STOP_GRACE_S`) after a SIGTERM, before torchrun's SIGKILL.  Main thread only; a no-op
    elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return
    grace = STOP_GRACE_S if grace is None else grace

    def take(signum, frame):
        name = signal.Signals(signum).name
        if not _dist_up():  # still starting: nothing to save
            _end(_starting(name), signum)
        _taken["name"] = _taken["name"] or name

    signal.signal(signal.SIGTERM, take)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read, grace), name="prismdp-sigterm-watchdog", daemon=True).start()


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on a signal after ``step`` steps; the checkpoint in ``output`` holds that step.  ``main``:
    raised in the process that reports (rank 0 of a multi-process run)."""

    def __init__(self, step: int, total: int, output: str, signame: str, main: bool = True):
        super().__init__(f"{signame}: stopped after step {step} of {total}; checkpoint saved in {output}")
        self.step, self.total, self.output, self.signame, self.main = step, total, output, signame, main


class StopRequest:
    """Context manager: while active, SIGINT/SIGTERM set :attr:`signame` instead of raising (main thread only; in other
    threads signals cannot be caught and nothing changes)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, log=print, escalate: bool = True):
        self.log, self.escalate = log, escalate
        self.signame: str | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signame is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signame is None:
            self.signame = name
            self.log(f"\n[prismdp] {name}: finishing the current step, then saving a checkpoint"
                     + (" (Ctrl-C again to stop at once, losing the steps since the last checkpoint)"
                        if self.escalate else ""))
        elif self.escalate and signum == signal.SIGINT:
            raise KeyboardInterrupt

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        taken = termination_requested()  # a SIGTERM taken before the loop (a multi-process run's guard)
        if taken is not None and self.signame is None:
            self._handle(signal.Signals[taken].value, None)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
