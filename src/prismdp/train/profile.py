"""What a run costs, as the paper's runtime table (Table 5) reports it: step time after warm-up, peak memory.

Step times: the mean and median over the steps after the first ``WARMUP_STEPS`` (the paper: 10 warm-up updates,
then the measured ones), or over all steps when a run has fewer than twice that many.

Peak memory of a stretch of training:
On a CUDA device: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.  On the CPU: the process's
peak resident set, ``VmHWM`` from ``/proc/self/status`` after resetting it to the current RSS through
``/proc/self/clear_refs`` (Linux >= 4.0), so model loading before the reset does not count.  Some kernels and
sandboxes accept the write and ignore it: the reset is checked (the peak must have dropped to the current RSS), and
when it did not take, ``VmHWM`` is still read but ``measure`` says that it includes the peak before ``start()``.
Elsewhere ``ru_maxrss`` (which includes it too).  ``measure`` names which one was used.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["PeakMemory", "status_kb", "WARMUP_STEPS", "RESET", "NOT_RESET", "step_time_stats", "run_step_times"]

WARMUP_STEPS = 10
RESET = "VmHWM after clear_refs (process peak RSS)"
NOT_RESET = "VmHWM, not reset: this kernel ignored clear_refs (process peak RSS, includes the peak before start)"
RESET_SLACK_KB = 4096  # RSS may shrink a little between the reset and the check


def step_time_stats(times: Sequence[float]) -> dict:
    """``{mean_step_time_s, median_step_time_s, timed_steps, warmup_steps}`` (empty for no steps)."""
    warm = WARMUP_STEPS if len(times) >= 2 * WARMUP_STEPS else 0
    measured = list(times[warm:])
    if not measured:
        return {}
    return {"mean_step_time_s": statistics.fmean(measured), "median_step_time_s": statistics.median(measured),
            "timed_steps": len(measured), "warmup_steps": warm}


def run_step_times(metrics_path: Path) -> dict:
    """:func:`step_time_stats` of a run's ``metrics.jsonl`` (resumed segments included); empty if it is absent."""
    from .run_folder import read_metrics

    times = [float(r["step_time_s"]) for r in read_metrics(Path(metrics_path))
             if isinstance(r.get("step_time_s"), (int, float))]
    return step_time_stats(times)


def status_kb(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


class PeakMemory:
    """``start()`` resets the peak, ``read()`` -> ``{"peak_memory_mb": ..., "measure": ...}``."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.measure = None

    def start(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.measure = "torch.cuda.max_memory_allocated"
            return self
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset the peak RSS to the current RSS
            reset = status_kb("VmHWM") <= status_kb("VmRSS") + RESET_SLACK_KB
            self.measure = (RESET if reset else NOT_RESET)
        except (OSError, RuntimeError):
            self.measure = "ru_maxrss (process peak RSS, includes loading)"
        return self

    def read(self) -> dict:
        if self.measure is None:
            raise RuntimeError("PeakMemory.read() before start()")
        if self.device.type == "cuda":
            mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.measure.startswith("VmHWM"):
            mb = status_kb("VmHWM") / 1024
        else:
            import resource
            import sys

            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            mb = kb / 2**20 if sys.platform == "darwin" else kb / 1024  # bytes on macOS, kB on Linux
        return {"peak_memory_mb": mb, "measure": self.measure}
