"""The benchmark runner's bookkeeping on tiny random models (no timing asserts: timings here are meaningless)."""

import importlib
import json
import re
import statistics
from pathlib import Path

import pytest
import torch

from bench.__main__ import main, markdown, measure_memory
from bench.common import interleaved_round
from bench.micro import HostSyncCounter, run_micro
from bench.workloads import VARIANTS, WORKLOADS


def test_micro_interleaving_charges_each_part_to_its_variant_and_rotates_the_order():
    """A fake clock advanced only by the parts: variant a's parts take 1, 2, 4 and b's 8, 16 (b has one part less),
    so the step times must be exactly 7 and 24 whichever order the parts ran in; the order rotates per part."""
    now, ran = [0.0], []

    def part(name, dt):
        def run():
            ran.append(name)
            now[0] += dt
        return run

    parts = {"a": [part("a", 1), part("a", 2), part("a", 4)], "b": [part("b", 8), part("b", 16)]}
    took = interleaved_round(parts, clock=lambda: now[0])
    assert took == {"a": 7, "b": 24}
    assert ran == ["a", "b", "b", "a", "a"]
    ran.clear()
    assert interleaved_round(parts, clock=lambda: now[0], interleave="step") == {"a": 7, "b": 24}
    assert ran == ["a", "a", "a", "b", "b"]


def test_runner_interleaves_variants_and_writes_consistent_results(tmp_path):
    assert main(["--workloads", "tiny-bert", "--steps", "3", "--warmup", "1", "--threads", "1", "--no-memory",
                 "--micro-sizes", "32,64", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    (res,) = report["workloads"]
    assert list(res["variants"]) == list(VARIANTS)
    for name, v in res["variants"].items():
        assert len(v["times_s"]) == 3 and v["median_s"] == statistics.median(v["times_s"])
        assert v["min_s"] <= v["median_s"] <= v["max_s"]
        private = name not in ("lora-adamw", "lora-adamw-own-loss")
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
    from bench.studies.secure_noise import main as secure_main

    assert secure_main(["--workloads", "tiny-bert", "--rounds", "2", "--dataset", "1000", "--threads", "1",
                        "--output", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "noise.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["prism", "dp-adamw"]
    assert all(r["coordinates"] > 0 and r["median_s"]["noise_secure"] > 0 for r in rows)
    assert "| tiny-bert | prism |" in (tmp_path / "noise.md").read_text()


def test_secure_noise_written_out_llama_1b_shapes_match_the_model():
    """The 1B workload's noise shapes (no model built) against Llama-3.2-1B's own Linear layers on the meta device:
    r (in + out) coordinates per q/k/v/up/down module, 7,602,176 in all for r = 16, the same for both methods."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.studies.secure_noise import _shapes

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    targets = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
    want = sum(16 * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    assert want == 7_602_176
    for method in ("prism", "dp-adamw"):
        assert sum(s.numel() for s, _ in _shapes("llama-3.2-1b-r16", method)) == want


def test_extrapolation_counts_every_linear_layer_of_the_three_shapes():
    """The flop model's multiply-adds per token equal the Linear weights of the models themselves (built on the meta
    device from their configurations: an independent count)."""
    import torch
    from torch import nn
    from transformers import (BertConfig, BertForSequenceClassification, Gemma3ForCausalLM, Gemma3TextConfig,
                              LlamaConfig, LlamaForCausalLM)

    from bench import extrapolate as ex

    with torch.device("meta"):
        models = {
            "Gemma-3-4B": Gemma3ForCausalLM(Gemma3TextConfig(
                hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                num_key_value_heads=4, head_dim=256, vocab_size=262144)),
            "W2": LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)),
            "W1": BertForSequenceClassification(BertConfig(hidden_size=384, intermediate_size=1536,
                                                           num_hidden_layers=6, num_attention_heads=12)),
        }
    for name, model in models.items():
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        assert ex.SHAPES[name].linear_params == linear, name
        lora = sorted((m.weight.shape[0], m.weight.shape[1]) for n, m in model.named_modules()
                      if isinstance(m, nn.Linear) and n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "up_proj",
                                                                             "down_proj", "query", "key", "value"))
        assert sorted((m, n) for m, n, c in ex.SHAPES[name].modules for _ in range(c)) == lora, name


def test_extrapolation_fits_the_micro_benchmark_and_reports_shares():
    """Micro rows made exactly linear in m + n: the fits recover the lines, the mechanism seconds follow the stated
    model (a per stack and call, the slope per unit of m + n), and the table carries the measured share."""
    from bench import extrapolate as ex

    rows = [{"m": d, "n": d, "b": 64, "accumulate_median_s": 1e-3 + 2e-7 * 2 * d, "step_median_s": 2e-3 + 1e-7 * 2 * d}
            for d in (256, 512, 1024, 2048)]
    assert ex._fit(rows, "accumulate_median_s") == pytest.approx((1e-3, 2e-7))
    s = ex.SHAPES["W2"]
    width = sum(c * (m + n) for m, n, c in s.modules)
    expected = 4 * (2 * 1e-3 + 2e-3) + width * (2e-7 * 8 / 64 + 1e-7)
    assert ex.mechanism_seconds(s, {"rows": rows}) == pytest.approx(expected)
    workloads = [{"workload": "W2", "variants": {"lora-adamw": {"median_s": 6.0},
                                                  "prism": {"mechanism_median_s": 0.2, "mechanism_share": 0.03}}}]
    ext = ex.extrapolate({"rows": rows}, workloads)
    assert ext["cpu_flop_rate"] == pytest.approx(ex.step_flops(s) / 6.0)
    w2 = next(r for r in ext["rows"] if r["shape"] == "W2")
    assert w2["measured_share"] == 0.03 and w2["cpu_step_s"] == pytest.approx(6.0)
    assert 0 < w2["flop_share"] < 0.05 and "| Gemma-3-4B |" in "\n".join(ex.markdown(ext))


def test_profile_counts_the_compensations_flops_and_time(tmp_path):
    """bench.profile on the tiny BERT: PRISM's compensation shows as extra matrix flops and as time under its
    autograd functions; without the compensation neither appears."""
    from bench.profile import main as profile_main

    assert profile_main(["--workloads", "tiny-bert", "--variants", "prism-no-dropout-comp,prism", "--steps", "1",
                         "--warmup", "1", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    (res,) = report["workloads"]
    plain, comp = res["variants"]["prism-no-dropout-comp"], res["variants"]["prism"]
    assert plain["compensation_us"] == 0 < comp["compensation_us"]
    # the products of width 2r cost 2 r (m + n) more per token and module forward, as much again for the input
    # gradient, which the first layer (below it only the frozen embeddings) skips: 2 layers x query/value (32 x 32),
    # r 4, 8 x 16 tokens -- counted by hand; any extra product (e.g. a gradient formed for nothing) breaks it
    per_token = 2 * 4 * (32 + 32)
    assert comp["flops"] - plain["flops"] == 128 * per_token * (2 * 1 + 2 * 2)
    from bench.extrapolate import Shape, compensation_flops

    bound = compensation_flops(Shape("tiny", [(32, 32, 4)], 0, 2, 32, 16, 8, 4, r=4))
    assert comp["flops"] - plain["flops"] <= bound == 128 * per_token * 4 * 2
    assert "| prism |" in (tmp_path / "profile.md").read_text()


def test_own_loss_reference_takes_the_same_gradient_as_the_per_example_mean_on_full_batches():
    # bench's issue-30 reference (the model's own token-mean loss, labels=) against prismdp's per-example mean: on
    # the bench's batches every example has the same number of target tokens, so the two losses and gradients agree
    from bench.workloads import OWN_LOSS, build_variant

    w = WORKLOADS["tiny-llama"]
    base = w.load()
    grads = {}
    for name in ("lora-adamw", OWN_LOSS):
        v = build_variant(name, w, base)
        torch.manual_seed(1)  # the same LoRA dropout masks
        for part in v.parts[:-1]:  # the micro-batches, not the update
            part()
        micro = v.parts[0].func  # functools.partial(micro, ids, mask, labels): its closure holds the model
        model = micro.__closure__[micro.__code__.co_freevars.index("model")].cell_contents
        grads[name] = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    assert len(grads["lora-adamw"]) == 16 and any(g.abs().sum() > 0 for g in grads[OWN_LOSS])
    for a, b in zip(grads["lora-adamw"], grads[OWN_LOSS]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_loss_benchmark_writes_its_sections_and_ratios(tmp_path):
    from bench.loss import main as loss_main

    assert loss_main(["--workload", "tiny-llama", "--rounds", "2", "--warmup", "1", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "loss.json").read_text())
    assert set(report["sections"]) == {"step", "loss"} and report["vocab"] == 200
    for sec in report["sections"].values():
        assert list(sec) == ["own", "old", "new"]
        assert sec["own"]["over_own_paired_median"] == 1.0
        for v in sec.values():
            assert len(v["times_s"]) == 2 and v["median_s"] == statistics.median(v["times_s"])
    assert "new / own <= 1.10" in (tmp_path / "loss.md").read_text()
    with pytest.raises(ValueError, match="needs a causal-LM workload"):
        loss_main(["--workload", "tiny-bert", "--output", str(tmp_path)])


def test_the_benchmarks_old_loss_is_the_formula_before_issue_30():
    from bench.loss import old_causal_lm_losses
    from prismdp.losses import causal_lm_losses

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 7, 11, generator=g, dtype=torch.float64), torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :4] = -100
    torch.testing.assert_close(old_causal_lm_losses(logits, labels).double(), causal_lm_losses(logits, labels),
                               rtol=1e-6, atol=1e-6)


def test_every_study_imports_and_has_its_section_and_command_in_docs_studies():
    """bench/studies/ holds the one-off studies that still run: each imports, and docs/studies.md has its section and
    exact command; a deleted study's section says so ("deleted") and names the commit it ran at."""
    root = Path(__file__).resolve().parents[1]
    names = sorted(p.stem for p in (root / "bench" / "studies").glob("*.py") if p.stem != "__init__")
    text = (root / "docs" / "studies.md").read_text()
    sections = re.findall(r"^## (\w+):(.*)$", text, re.M)
    assert sorted(name for name, title in sections if "deleted" not in title) == names
    for name in names:
        assert f"python -m bench.studies.{name}" in text, name
        assert callable(importlib.import_module(f"bench.studies.{name}").main), name
