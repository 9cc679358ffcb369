"""Run cost bookkeeping (the paper's Table 5): step times after warm-up, peak memory, the device setting."""

import json
import subprocess
import sys

import pytest
import torch

from prismdp.train.config import ConfigError, TrainConfig
from prismdp.train.profile import NOT_RESET, RESET, WARMUP_STEPS, PeakMemory, run_step_times, step_time_stats


def test_step_time_stats_skip_the_warmup_only_for_long_enough_runs():
    long = [100.0] * WARMUP_STEPS + [1.0, 2.0, 3.0] * WARMUP_STEPS
    s = step_time_stats(long)
    assert s["warmup_steps"] == WARMUP_STEPS and s["timed_steps"] == 3 * WARMUP_STEPS
    assert s["mean_step_time_s"] == pytest.approx(2.0) and s["median_step_time_s"] == 2.0
    short = [5.0, 1.0, 3.0]
    assert step_time_stats(short) == {"mean_step_time_s": 3.0, "median_step_time_s": 3.0, "timed_steps": 3,
                                      "warmup_steps": 0}
    assert step_time_stats([]) == {}


def test_run_step_times_reads_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i + 1, "step_time_s": float(i)}) + "\n" for i in range(4)))
    assert run_step_times(path)["mean_step_time_s"] == pytest.approx(1.5)
    assert run_step_times(tmp_path / "absent.jsonl") == {}


_ALLOCATE_AFTER_START = """
import json, torch
from prismdp.train.profile import PeakMemory, status_kb
peak = PeakMemory("cpu").start()
before = peak.read()["peak_memory_mb"]
big = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
big.add_(1.0)
print(json.dumps({"before": before, "after": peak.read(), "rss_mb": status_kb("VmRSS") / 1024}))
"""


def test_peak_memory_sees_an_allocation_made_after_start():
    # In a fresh process: inside the test session, memory freed by earlier tests can stay resident and serve the
    # allocation without any rise in RSS (seen on a full run: RSS and peak unchanged after the 64 MB tensor).
    out = subprocess.run([sys.executable, "-c", _ALLOCATE_AFTER_START], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = got["before"], got["after"]
    assert after["peak_memory_mb"] >= before and after["measure"] in (RESET, NOT_RESET)
    assert after["peak_memory_mb"] >= got["rss_mb"] - 1  # a peak is never below the current RSS
    if after["measure"] == RESET:  # a reset peak sees the new allocation (an unreset one may sit above it)
        assert after["peak_memory_mb"] - before > 50
    with pytest.raises(RuntimeError, match="before start"):
        PeakMemory("cpu").read()


def test_device_setting_is_checked_before_anything_runs():
    assert TrainConfig().torch_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert TrainConfig(device="cpu").torch_device() == torch.device("cpu")
    with pytest.raises(ConfigError, match="device: 'gpu0' is not a torch device"):
        TrainConfig(device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device: 'cuda:0' is not available here"):
            TrainConfig(device="cuda:0")


def test_peak_memory_says_when_the_kernel_ignored_the_reset(monkeypatch, tmp_path):
    """A sandbox that accepts the clear_refs write but keeps the old peak must not be reported as a reset peak."""
    import prismdp.train.profile as profile

    fields = {"VmHWM": 900_000, "VmRSS": 300_000}  # kB: the old peak stays far above the current RSS
    monkeypatch.setattr(profile, "status_kb", lambda key: fields[key])
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(tmp_path / "clear_refs", *a, **k)
                        if str(path) == "/proc/self/clear_refs" else real_open(path, *a, **k))
    peak = PeakMemory("cpu").start()
    assert peak.measure == NOT_RESET and peak.read()["peak_memory_mb"] == pytest.approx(900_000 / 1024)
    fields["VmHWM"] = 300_500  # the reset took: the peak is the current RSS
    assert PeakMemory("cpu").start().measure == RESET
