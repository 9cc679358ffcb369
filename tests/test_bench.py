"""The benchmark runner's bookkeeping on tiny random models (no timing asserts: timings here are meaningless)."""

import json
import statistics

import pytest

from bench.__main__ import main, markdown, measure_memory
from bench.micro import HostSyncCounter, run_micro
from bench.workloads import VARIANTS, WORKLOADS


def test_runner_interleaves_variants_and_writes_consistent_results(tmp_path):
    assert main(["--workloads", "tiny-bert", "--steps", "3", "--warmup", "1", "--threads", "1", "--no-memory",
                 "--micro-sizes", "32,64", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    (res,) = report["workloads"]
    assert list(res["variants"]) == list(VARIANTS)
    for name, v in res["variants"].items():
        assert len(v["times_s"]) == 3 and v["median_s"] == statistics.median(v["times_s"])
        assert v["min_s"] <= v["median_s"] <= v["max_s"]
        private = name != "lora-adamw"
        assert (v["mechanism_share"] is not None) == private
        if private:
            assert 0 < v["mechanism_share"] < 1
    # no host synchronisation inside PRISM's module loop: one read per micro-batch, and only on the CPU, where it is
    # free (prismdp.privacy.clipping.contributing); clip statistics stay on the device
    assert res["variants"]["prism"]["mechanism_host_syncs_per_step"] == WORKLOADS["tiny-bert"].n_micro
    r = res["ratios"]["prism / dp-adamw"]
    times = res["variants"]
    paired = [a / b for a, b in zip(times["prism"]["times_s"], times["dp-adamw"]["times_s"])]
    assert r["paired_median"] == pytest.approx(statistics.median(paired))
    assert r["ratio_of_medians"] == pytest.approx(times["prism"]["median_s"] / times["dp-adamw"]["median_s"])
    assert set(res["ratios"]) >= {"prism / dp-adamw", "dp-adamw / opacus-dp-adamw", "prism / lora-adamw"}
    rows = report["micro"]["rows"]
    assert [row["m"] for row in rows] == [32, 64] and all(row["host_syncs_per_step"] == 1 for row in rows)
    assert all(row["dense_median_s"] > 0 for row in rows)
    md = (tmp_path / "bench.md").read_text()
    assert md == markdown(report) and "| prism / dp-adamw |" in md and "| 64 |" in md


def test_memory_runs_each_variant_in_its_own_process():
    mem = measure_memory("tiny-bert", ["dp-adamw", "prism"], threads=1, steps=1, log=lambda *_: None)
    assert mem["dp-adamw"]["peak_rss_mb"] > 50 and mem["prism"]["peak_rss_mb"] > 50
    assert mem["prism / dp-adamw"]["ratio"] == pytest.approx(mem["prism"]["peak_rss_mb"] /
                                                             mem["dp-adamw"]["peak_rss_mb"])


def test_host_sync_counter_counts_device_to_host_copies():
    import torch

    t = torch.randn(4)
    with HostSyncCounter() as c:
        float(t[0]), t.sum().item(), t.tolist(), bool(t[1] > 0)
        t * 2 + 1  # no copy to the host
    assert c.count == 4


def test_micro_benchmark_skips_the_dense_reference_above_its_limit():
    out = run_micro([32, 64], steps=1, warmup=0, dense_max=32, log=lambda *_: None)
    assert out["rows"][0]["dense_median_s"] is not None and out["rows"][1]["dense_median_s"] is None
    assert out["prism_8192_over_1024"] is None


def test_secure_noise_variants_are_timed_beside_the_default(tmp_path):
    assert main(["--workloads", "tiny-bert", "--variants", "prism,prism-secure,dp-adamw,dp-adamw-secure", "--steps",
                 "2", "--warmup", "0", "--threads", "1", "--no-memory", "--micro-sizes", "32", "--output",
                 str(tmp_path)]) == 0
    (res,) = json.loads((tmp_path / "bench.json").read_text())["workloads"]
    assert {"prism-secure / prism", "dp-adamw-secure / dp-adamw"} <= set(res["ratios"])
    assert all(res["variants"][v]["mechanism_share"] > 0 for v in ("prism-secure", "dp-adamw-secure"))


def test_secure_noise_draw_benchmark_writes_its_table(tmp_path):
    from bench.secure_noise import main as secure_main

    assert secure_main(["--workloads", "tiny-bert", "--rounds", "2", "--dataset", "1000", "--threads", "1",
                        "--output", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "noise.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["prism", "dp-adamw"]
    assert all(r["coordinates"] > 0 and r["median_s"]["noise_secure"] > 0 for r in rows)
    assert "| tiny-bert | prism |" in (tmp_path / "noise.md").read_text()
