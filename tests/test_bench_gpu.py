"""``python -m bench.gpu`` on the CPU with tiny shapes: its bookkeeping, its FLOP count, its out-of-memory handling and
the frozen weights its variants share (no timing asserts: timings here are meaningless)."""

import json
import statistics
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import bench.gpu as gpu
from bench.gpu_models import SHAPES, bf16_peak_tflops, build_base, flops_per_token, sanitize
from bench.gpu_variants import VARIANTS, batch, build_variant


def _run(tmp_path, *args):
    return gpu.main(["--output", str(tmp_path), "--time-budget", "900", *args])


def test_tiny_run_writes_every_variant_with_consistent_bookkeeping(tmp_path):
    assert _run(tmp_path, "--tiny", "--micro", "8,4", "--rounds", "2", "--min-rounds", "2") == 0
    report = json.loads((tmp_path / "gpu-cpu-tiny.json").read_text())
    assert report["status"] == "complete" and report["tiny"]
    assert report["command"][:3] == ["python", "-m", "bench.gpu"] and "--tiny" in report["command"]
    env = report["environment"]
    assert env["device"] == "cpu" and env["peak_tflops"] is None
    assert set(env["versions"]) == {"torch", "transformers", "peft", "opacus", "prismdp"}
    assert [r["shape"] for r in report["shapes"]] == ["tiny-llama", "tiny-gemma"]
    for res in report["shapes"]:
        # the largest first, those that divide the logical batch (8 for tiny-llama, 4 for tiny-gemma)
        assert [c["micro"] for c in res["cells"]] == ([8, 4] if res["shape"] == "tiny-llama" else [4])
        tokens = res["tokens_per_step"]
        assert tokens == SHAPES[res["shape"]].batch * SHAPES[res["shape"]].seq_len
        assert res["flops_per_token"] == pytest.approx(flops_per_token(SHAPES[res["shape"]]))
        for cell in res["cells"]:
            assert cell["rounds"] == 2 and list(cell["variants"]) == list(VARIANTS)
            for v in cell["variants"].values():
                assert v["status"] == "ok" and len(v["times_s"]) == 2
                assert v["median_s"] == statistics.median(v["times_s"])
                assert v["tokens_per_s"] == pytest.approx(tokens / v["median_s"])
                assert v["mfu"] is None and v["peak_gb"] is None  # no bf16 peak, no CUDA memory on the CPU
                assert isinstance(v["host_syncs_per_step"], int) and v["cuda_syncs_per_step"] is None
            times = {n: v["times_s"] for n, v in cell["variants"].items()}
            assert cell["paired"]["prism / dp-adamw"] == pytest.approx(
                statistics.median(a / b for a, b in zip(times["prism"], times["dp-adamw"])))
        for n, b in res["best"].items():
            medians = {c["micro"]: c["variants"][n]["median_s"] for c in res["cells"]}
            assert b["micro"] == min(medians, key=medians.get) and b["median_s"] == min(medians.values())
        assert set(res["ratios"]) == {name for name, *_ in gpu.RATIOS}
        for name, a, b, target in gpu.RATIOS:
            r = res["ratios"][name]
            assert r["ratio_of_best_medians"] == pytest.approx(res["best"][a]["median_s"] / res["best"][b]["median_s"])
            assert r["micro"] == [res["best"][a]["micro"], res["best"][b]["micro"]] and r["target"] == target
            assert r["paired_median_by_micro"] == {str(c["micro"]): c["paired"][name] for c in res["cells"]}
    md = (tmp_path / "gpu-cpu-tiny.md").read_text()
    assert md == gpu.markdown(report) and "not a measurement" in md
    assert all(f"| {n} | 4 |" in md for n in VARIANTS) and "| prism / dp-adamw |" in md


def test_flops_per_token_against_a_hand_count():
    """tiny-llama (d 64, ff 128, 2 layers, 4 heads and 2 KV heads of 16, V 256, T 16, r 4 on q/k/v/up/down) and
    tiny-gemma (d 48, ff 96, H 2 / KV 1 of 32, V 320, a sliding window of 8 in its first layer), written out."""
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q k v o gate up down
    lora = 6 * 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 128) + (128 + 64))
    want = {"base": 4 * 2 * per_layer, "attention": 2 * 12 * 16 * (4 * 16), "head": 4 * 64 * 256, "lora": 2 * lora}
    got = flops_per_token(SHAPES["tiny-llama"])
    assert {k: got[k] for k in want} == want and got["total"] == sum(want.values()) == 418_816
    per_layer = 48 * 64 + 48 * 32 + 48 * 32 + 64 * 48 + 3 * 48 * 96
    lora = 6 * 4 * ((48 + 64) + (48 + 32) + (48 + 32) + (48 + 96) + (96 + 48))
    want = {"base": 4 * 2 * per_layer, "attention": 12 * (2 * 32) * (8 + 16), "head": 4 * 48 * 320,
            "lora": 2 * lora}
    got = flops_per_token(SHAPES["tiny-gemma"])
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma", "llama-3.2-1b", "gemma-3-4b"])
def test_flops_per_token_against_the_built_models_linear_layers(name):
    """The config-formula count against the model's own ``nn.Linear`` weights (built on the meta device: no memory),
    and Llama-3.2-1B's published parameter count (1,235,814,400)."""
    shape = SHAPES[name]
    model = build_base(shape, "meta")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    body = sum(m.weight.numel() for n, m in linears.items() if n != "lm_head")
    lora = sum(6 * shape.rank * (m.in_features + m.out_features) for n, m in linears.items()
               if n.split(".")[-1] in shape.targets)
    f = flops_per_token(shape)
    assert f["base"] == 4 * body and f["head"] == 4 * linears["lm_head"].weight.numel() and f["lora"] == lora
    assert all(p.dtype == torch.bfloat16 and p.is_meta for p in model.parameters())
    if name == "llama-3.2-1b":
        assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
        assert f["total"] == pytest.approx(4.9e9, rel=0.05)  # ~4 N per token for LoRA training


def test_narrow_llama_has_llama_1b_s_structure():
    """The CPU stand-in for a host-bound Llama-3.2-1B step: the same modules by name (meta device), hence the same
    LoRA targets, stacks of equal shape and operators per step, the same logical batch and micro-batches."""
    from prismdp.lora import find_lora_pairs, stack_by_shape

    from bench.gpu_variants import _peft

    narrow, real = SHAPES["narrow-llama"], SHAPES["llama-3.2-1b"]
    assert (narrow.batch, narrow.micro_sizes[-1], narrow.targets) == (real.batch, real.micro_sizes[-1], real.targets)
    models = [_peft(build_base(s, "meta"), s, 0.0) for s in (narrow, real)]
    names = [[n for n, _ in m.named_modules()] for m in models]
    assert names[0] == names[1] and len(names[0]) > 1000
    stacks = [stack_by_shape(find_lora_pairs(m)) for m in models]
    assert stacks[0] == stacks[1] and len(stacks[0]) == 4


def test_peak_table_and_file_names():
    assert bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bf16_peak_tflops("NVIDIA H200") == 989.0
    assert bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bf16_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bf16_peak_tflops("Some Other GPU") is None
    assert sanitize("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_out_of_memory_is_recorded_and_the_variant_rebuilt_for_smaller_micro_batches(tmp_path, monkeypatch):
    """A fake out-of-memory error at micro-batches of 4 and more for prism: its cells say so, it is rebuilt for each
    smaller size and measured at 2; another variant failing with an error is recorded and the run exits 1."""
    builds = []

    def fake_build(name, shape, base, ids):
        v = build_variant(name, shape, base, ids)
        builds.append(name)
        run = v.run

        def step(micro):
            if name == "prism" and micro >= 4:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
            if name == "dp-adamw" and micro == 2:
                raise ValueError("a planted bug")
            run(micro)

        v.run = step
        return v

    monkeypatch.setattr(gpu, "build_variant", fake_build)
    assert _run(tmp_path, "--shapes", "tiny-llama", "--variants", "reference,prism,dp-adamw", "--rounds", "1",
                "--min-rounds", "1") == 1
    report = json.loads((tmp_path / "gpu-cpu-tiny.json").read_text())
    (res,) = report["shapes"]
    cells = {c["micro"]: c["variants"] for c in res["cells"]}
    assert list(cells) == [8, 4, 2]
    assert res["variants"]["prism"]["status"] == "out of memory"  # its first step, at 8
    assert cells[8]["prism"]["status"] == cells[4]["prism"]["status"] == "out of memory"
    assert "fake" in cells[4]["prism"]["error"]
    assert cells[2]["prism"]["status"] == "ok" and len(cells[2]["prism"]["times_s"]) == 1
    assert builds.count("prism") == 3  # built, then rebuilt for 4 and for 2
    assert cells[2]["dp-adamw"]["status"] == "error" and "planted bug" in cells[2]["dp-adamw"]["error"]
    assert all(cells[m]["reference"]["status"] == "ok" for m in cells)
    assert res["best"]["prism"]["micro"] == 2 and res["best"]["dp-adamw"]["micro"] in (8, 4)
    assert report["status"].startswith("errors")
    md = (tmp_path / "gpu-cpu-tiny.md").read_text()
    assert "| prism | 8 | out of memory |" in md and "| dp-adamw | 2 | error |" in md


def test_variants_share_the_frozen_weights_they_leave_unchanged(monkeypatch):
    """Every variant shares the base's tensors except prism's (without dropout) target weights, which its rank-r
    start changes; after building and a step of each, the base is bit for bit what it was.  Sharing a tensor a
    variant changes is caught."""
    import bench.gpu_variants as gv

    shape = SHAPES["tiny-llama"]
    base = build_base(shape, "cpu")
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    ids = batch(shape, base.get_input_embeddings().num_embeddings, "cpu")
    q = base.model.layers[0].self_attn.q_proj.weight
    for name in VARIANTS:
        v = build_variant(name, shape, base, ids)
        v.step(4)
        v.check_shared()
        owns_targets = name in ("prism", "no-dp", "prism-householder", "prism-eager-loss", "prism-summed-grads",
                                "prism-tf32-products", "prism-bf16-products", "prism-secure")
        assert (id(q) in v.shared) != owns_targets and id(base.model.layers[0].self_attn.o_proj.weight) in v.shared
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())
    monkeypatch.setattr(gv, "changes_base", lambda spec: False)  # the planted bug: prism shares its targets
    with pytest.raises(RuntimeError, match="changed .* frozen tensor"):
        build_variant("prism", shape, base, ids)


def test_a_spent_time_budget_still_writes_the_files(tmp_path):
    assert gpu.main(["--output", str(tmp_path), "--time-budget", "0", "--tiny"]) == 0
    report = json.loads((tmp_path / "gpu-cpu-tiny.json").read_text())
    assert report["status"] == "partial: time budget"
    assert all(r["status"] == "skipped: time budget" for r in report["shapes"])
    assert "skipped: time budget" in (tmp_path / "gpu-cpu-tiny.md").read_text()


class _FakeVariant:
    def __init__(self, name, clock, dt, ran):
        self.name, self.model, self.shared = name, object(), {}
        self.clock, self.dt, self.ran = clock, dt, ran

    def step(self, micro):
        self.ran.append(self.name)
        self.clock.t += self.dt

    def check_shared(self):
        pass

    def release(self):
        self.model = None


class _FakeClock(gpu.Clock):
    def __init__(self, budget):
        self.t = 0.0
        super().__init__(budget, now=lambda: self.t)


@pytest.mark.parametrize("budget, cell_s, shape_s, rounds, min_rounds, want", [
    (100, 100, 100, 5, 2, 5),  # plenty of time: the most rounds
    (100, 5, 100, 5, 2, 2),    # the cell's share is spent after the warm-up: the least rounds
    (100, 5, 4, 5, 3, 1),      # the shape's share too: one round
    (4.4, 100, 100, 5, 2, 1),  # the budget: none past its end (warm-up 1.5 s, rounds of 1.5 s)
])
def test_run_cell_rounds_follow_the_time_shares(budget, cell_s, shape_s, rounds, min_rounds, want):
    clock, ran = _FakeClock(budget), []
    variants = {n: _FakeVariant(n, clock, dt, ran) for n, dt in (("a", 0.5), ("b", 1.0))}
    cell = gpu.run_cell(variants, 4, torch.device("cpu"), clock, cell_s, shape_s, rounds, min_rounds,
                        log=lambda m: None)
    assert cell["rounds"] == want
    assert cell["variants"]["a"]["times_s"] == [0.5] * want and cell["variants"]["b"]["times_s"] == [1.0] * want
    assert cell["variants"]["a"]["host_syncs_per_step"] == 0 and cell["variants"]["a"]["warmup_s"] == 0.5
    assert ran[:4] == ["a", "b", "a", "b"] and ran[4:6] == (["b", "a"] if want > 1 else [])  # rotated


def test_cuda_bookkeeping_with_a_fake_torch_cuda(monkeypatch):
    """The CUDA-only paths on the CPU: the step's peak above the allocated memory before it, the sync-debug
    warnings counted (and the mode reset after a failing step too), the environment's device fields, MFU."""
    mem, modes = {"alloc": 1000, "peak": 0}, []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mem["alloc"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: mem.update(peak=mem["alloc"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem["peak"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        mem["peak"] = mem["alloc"] + 7 * 2 ** 30
        for message in ("called a synchronizing CUDA operation", "called a synchronizing CUDA operation", "other"):
            warnings.warn(message)
        torch.ones(2).sum().item()  # one read to the host

    cuda = torch.device("cuda")
    assert gpu.timed_step(step, cuda)[1] == 7 * 2 ** 30
    _, host, syncs = gpu.counted_step(step, cuda)
    assert (host, syncs) == (1, 2) and modes == ["warn", "default"]

    def failing():
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    with pytest.raises(torch.OutOfMemoryError):
        gpu.counted_step(failing, cuda)
    assert modes[-1] == "default"
    assert gpu._failure(RuntimeError("CUDA error: out of memory"), 8)["status"] == "out of memory"

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=80 * 2 ** 30, major=9, minor=0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    env = gpu.environment(cuda)
    assert env["peak_tflops"] == 989.0 and env["device_memory_gb"] == 80 and env["capability"] == "9.0"

    res = {"flops_per_token": {"total": 4e9}, "tokens_per_step": 8192, "peak_tflops": 989.0, "cells": [
        {"micro": 8, "variants": {n: {"status": "ok", "times_s": [0.3, 0.1, 0.15],
                                      "peak_bytes": [2 ** 30, 3 * 2 ** 30]} for n in ("prism", "reference")}}]}
    gpu.summarize_shape(res)
    v = res["cells"][0]["variants"]["prism"]
    assert v["mfu"] == pytest.approx(4e9 * 8192 / 0.15 / 989e12) and v["peak_gb"] == 2.0
    assert res["memory_ratios"]["prism / reference"]["at_largest_common_micro"] == 1.0


def test_gpu_paths_checks_run_compare_and_fail_on_a_loss_gap(tiny_llama_dir, tmp_path, monkeypatch):
    """``python -m bench.gpu_paths`` on the CPU with the tiny Llama, tolerance 1e-6: the run resumed half-way passes
    against the bf16 run (same accounting, the same losses on the CPU); a planted path that computes something else
    (the job with another seed: other batches and noise) fails the comparison and counts in the exit code."""
    import bench.gpu_paths as paths

    monkeypatch.setitem(paths.CHECKS, "other-seed", (paths.BF16 + ["--seed", "1"], False, "bf16"))
    code = paths.main(["--model", tiny_llama_dir, "--device", "cpu", "--steps", "4", "--output", str(tmp_path),
                       "--only", "resume,other-seed", "--loss-tol", "1e-6"])
    checks = json.loads((tmp_path / "gpu-paths-cpu.json").read_text())["checks"]
    assert list(checks) == ["bf16", "resume", "other-seed"], checks
    assert all(len(c["losses"]) == 4 and c["privacy"] == checks["bf16"]["privacy"] for c in checks.values()), checks
    assert checks["bf16"]["status"] == checks["resume"]["status"] == "passed", checks
    assert checks["resume"]["exit_codes"] == [0, 0] and checks["resume"]["max_loss_gap_to_bf16"] == 0
    other = checks["other-seed"]
    assert other["status"] == "failed" and "losses differ from bf16's" in other["problems"][0], other
    assert other["max_loss_gap_to_bf16"] > 1e-6 and code == 1
    assert "| resume | passed |" in (tmp_path / "gpu-paths-cpu.md").read_text()


def test_gpu_profile_counts_each_kernel_once_and_writes_its_tables(tmp_path):
    import bench.gpu_profile as gp

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, dev, ann=False: SimpleNamespace(name=name, device_type=dev, is_user_annotation=ann)  # noqa: E731
    # the GPU span of a user annotation (an optimizer's step) covers kernels already counted: not work of its own
    assert gp._kind(ev("Optimizer.step#PRISM.step", cuda, ann=True)) is None
    assert gp._kind(ev("Command Buffer Full", cuda)) is None and gp._kind(ev("Buffer Flush", cpu)) is None
    assert gp._kind(ev("geqr2_smem_domino_fast", cuda)) == "kernel" and gp._kind(ev("aten::mm", cpu)) == "op"

    assert gp.main(["--shape", "tiny-llama", "--device", "cpu", "--variants", "reference,prism", "--steps", "1",
                    "--warmup", "1", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-profile-cpu.json").read_text())
    assert report["micro"] == 8 and list(report["variants"]) == ["reference", "prism"]
    ref, prism = (report["variants"][n] for n in ("reference", "prism"))
    assert ref["kernels"] == prism["kernels"] == 0 and ref["wall_s"] > 0  # no CUDA: host operators only
    assert ref["ops"]["aten::mm"]["calls"] > 0
    assert "aten::linalg_qr" in prism["ops"] and "aten::linalg_qr" not in ref["ops"]  # PRISM's frames
    # wall minus kernel time only where there are kernels; host reads counted per variant (PRISM reads its loss)
    assert ref["wall_minus_kernel_s"] is None and ref["cuda_syncs_per_step"] is None
    assert all(isinstance(r["host_syncs_per_step"], int) for r in (ref, prism))
    md = (tmp_path / "gpu-profile-cpu.md").read_text()
    assert "## prism minus reference, operators" in md and "## prism, operators" in md


@pytest.mark.parametrize("dtype, gram", [(torch.float64, None), (torch.float32, torch.float64)])
def test_gpu_qr_cholesky_qr2_is_the_qr_of_a_float64_householder_reference(tmp_path, dtype, gram):
    import bench.studies.gpu_qr as gq

    X = gq.factors(3, 200, 6, cond=1e4, device="cpu", seed=3).to(dtype)  # Q and R come back in X's dtype
    Q, R = gq.cholqr2(X, dtype, gram=gram)
    Qh, Rh = torch.linalg.qr(X.double())  # the reference: unique up to the signs of R's diagonal
    signs = torch.sign(torch.diagonal(Rh, dim1=-2, dim2=-1)).unsqueeze(-1)
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    assert torch.allclose(R.double(), Rh * signs, atol=tol * Rh.abs().max())
    assert torch.allclose(Q.double(), Qh * signs.mT, atol=tol)
    assert torch.equal(R, R.triu())
    # the second pass is what makes Q orthonormal to working precision (one pass: ~cond^2 eps64, ~cond eps32)
    assert gq.errors(X, Q, R)["orthogonality"] < (1e-13 if dtype == torch.float64 else 1e-6)
    assert gq.main(["--tiny", "--device", "cpu", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-qr-cpu.json").read_text())
    assert set(report["shapes"]["tiny (64)"]["candidates"]) == set(gq.CANDIDATES)


def test_gpu_loss_reports_each_variant_and_its_errors_catch_a_wrong_loss(tmp_path):
    import bench.gpu_loss as gl

    assert gl.main(["--tiny", "--device", "cpu", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-loss-cpu.json").read_text())
    (row,) = report["shapes"].values()
    assert set(row["variants"]) == {"own", "eager", "fused"}
    for name in ("eager", "fused"):  # float32-accurate losses of the bf16 values, bf16-rounded gradients
        rec = row["variants"][name]
        assert rec["ms"] > 0 and rec["loss_rel"] < 1e-6 and rec["grad_abs"] < 2e-3, (name, rec)
    assert row["variants"]["own"]["loss_rel"] < 1e-6 and "grad_abs" not in row["variants"]["own"]
    # the measure itself: a loss off by its target's logit (softmax without the one-hot) is reported, not hidden
    b, T, V = 2, 16, 1000
    logits = torch.randn(b, T, V).to(torch.bfloat16)
    labels = torch.randint(0, V, (b, T))
    wrong = gl.errors(lambda x, y: torch.logsumexp(x[:, :-1].float(), dim=2).mean(dim=1), logits, labels)
    assert wrong["loss_rel"] > 1e-3 and wrong["grad_abs"] > 1e-2  # both far above the limits above
    assert "| fused |" in (tmp_path / "gpu-loss-cpu.md").read_text()


@pytest.mark.parametrize("module", ["bench.gpu", "bench.gpu_profile", "bench.gpu_loss", "bench.studies.gpu_qr"])
def test_a_device_this_torch_cannot_use_is_a_one_line_refusal(module, monkeypatch, capsys, tmp_path):
    """``--device cuda`` on a torch without CUDA (issue 42 defect 7: an assertion traceback) and a misspelt device:
    exit 2, one line on stderr naming the problem and the fix, nothing written."""
    import importlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main = importlib.import_module(module).main
    for device, words in (("cuda", "sees no CUDA device"), ("gpu0", "is not a device")):
        assert main(["--device", device, "--output", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"python -m {module}: error: --device" in err and words in err, err
        assert "--device cpu" in err or "cuda, cuda:N or cpu" in err
    assert not any(tmp_path.iterdir())


def test_the_time_budget_holds_while_a_model_is_built(tmp_path, monkeypatch):
    """A build slower than the budget (a full-size model on the CPU) is cut at the deadline: the shape says so, the
    next is skipped, the files are written and the run is partial; without the hard deadline the build ran to its
    end (issue 42 defect 7: ``--time-budget 30`` ignored while full-size models were built)."""
    import time

    built = []

    def slow_build(shape, device, *a, **k):
        for _ in range(100):  # 10 s in small slices, as a model's tensors are initialised one by one
            time.sleep(0.1)
        built.append(shape.name)
        return build_base(shape, device)

    monkeypatch.setattr(gpu, "build_base", slow_build)
    env = gpu.environment(torch.device("cpu"))
    monkeypatch.setattr(gpu, "environment", lambda device: env)  # (git and metadata: slow on a loaded machine)
    flops_per_token(SHAPES["tiny-llama"])  # its first call imports transformers' model classes (seconds)
    assert gpu.main(["--output", str(tmp_path), "--time-budget", "3", "--tiny"]) == 0
    assert built == []
    report = json.loads((tmp_path / "gpu-cpu-tiny.json").read_text())
    assert [r["status"] for r in report["shapes"]] == ["cut: time budget", "skipped: time budget"]
    assert report["status"] == "partial: time budget"  # built == []: the slow build never finished (no wall time)


def test_prismdp_variants_read_the_step_loss_as_the_training_loop_does():
    """The prismdp variants read the logical batch's loss to the host as ``prismdp train`` does (a synchronisation
    the GPU benchmark must pay): the mean per-example loss of the batch, computed here independently from the
    model's logits before the step."""
    from prismdp.losses import causal_lm_losses

    shape = SHAPES["tiny-llama"]
    base = build_base(shape, "cpu")
    ids = batch(shape, base.get_input_embeddings().num_embeddings, "cpu")
    for name in ("prism", "dp-adamw", "no-dp"):
        v = build_variant(name, shape, base, ids)
        with torch.no_grad():
            want = torch.cat([causal_lm_losses(v.model(input_ids=ids[s:s + 4]).logits.float(), ids[s:s + 4])
                              for s in (0, 4)]).double().mean().item()
        v.model.train()
        v.step(4)
        assert isinstance(v.loss, float) and v.loss == pytest.approx(want, rel=1e-4), name
    ref = build_variant("reference", shape, base, ids)
    ref.step(4)
    assert ref.loss is None  # the PEFT reference reads nothing (as a plain loop would not)
