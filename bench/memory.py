"""Peak memory of a PRISM step on the packaged SmolLM2-135M (issue 27): float32, bfloat16, a 4-bit base, and
gradient checkpointing; then the same extrapolated to 8B and 70B models (the formula is in the Markdown).

Each configuration runs in its own process (a process's peak resident set only grows): it builds the run with
``prismdp.train.build.build_run`` (task instruct, generated records, PRISM, LoRA r 16 on q/k/v/up/down, micro-batch
8 x 128 tokens), records the resident set after the build, resets the peak (:class:`prismdp.train.profile.PeakMemory`)
and runs ``--steps`` logical steps; it reports the peak resident set of the steps and what the frozen weights and the
LoRA factors hold.  On this CPU machine the peak resident set is what can be measured (not GPU memory): it includes
the interpreter and libraries (the "process" row), allocator slack and, on the CPU, bitsandbytes' float copy of each
4-bit weight while it multiplies.

    PYTHONPATH=src python -m bench.memory [--steps 2] [--output bench/results/memory]
    PYTHONPATH=src python -m bench.memory --one 4bit > rows.jsonl   # one configuration; then --rows rows.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name: TrainConfig overrides
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "4bit": {"quantize": "4bit"},
    "float32 + checkpointing": {"gradient_checkpointing": True},
    "bfloat16 + checkpointing": {"dtype": "bfloat16", "gradient_checkpointing": True},
    "4bit + checkpointing": {"quantize": "4bit", "gradient_checkpointing": True},
}
MICRO, LENGTH, RANK = 8, 128, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]

# models to extrapolate to: layers, hidden, intermediate, kv heads x head dim, vocab, parameters, tied embeddings
MODELS = {
    "SmolLM2-135M": dict(layers=30, hidden=576, inter=1536, kv=192, vocab=49152, params=134.5e6, tied=True),
    "Llama-3.1-8B": dict(layers=32, hidden=4096, inter=14336, kv=1024, vocab=128256, params=8.03e9, tied=False),
    "Llama-3.1-70B": dict(layers=80, hidden=8192, inter=28672, kv=1024, vocab=128256, params=70.6e9, tied=False),
}
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "4bit": 0.5 + 4 / 64}  # NF4: 4 bits + a float32 absmax per 64
CARDS = {"24 GB": (24, 1), "80 GB": (80, 1), "8 x 24 GB (FSDP)": (24, 8), "8 x 80 GB (FSDP)": (80, 8)}  # (GB, GPUs)


def _records(n: int = 64) -> list[dict]:
    return [{"instruction": f"Add {i} and {i + 1}, then explain the sum in a long sentence. " * 3, "input": "",
             "output": f"The answer is {2 * i + 1}. " * 8} for i in range(n)]


def measure_one(name: str, steps: int) -> dict:
    """One configuration in this process."""
    import torch

    from prismdp.train.build import build_run
    from prismdp.train.config import TrainConfig
    from prismdp.train.profile import PeakMemory, status_kb
    from bench.train_job import _stepper

    torch.set_num_threads(2)
    rss0 = status_kb("VmRSS") / 1024
    tmp = Path(tempfile.mkdtemp(prefix="prismdp-memory-"))
    (tmp / "data.json").write_text(json.dumps(_records()))
    cfg = TrainConfig(model=None, task="instruct", data=str(tmp / "data.json"), steps=steps, batch_size=MICRO,
                      micro_batch_size=MICRO, max_length=LENGTH, rank=RANK, alpha=RANK, target_modules=TARGETS,
                      epsilon=8.0, output=str(tmp / "run"), **CONFIGS[name])
    run = build_run(cfg, log=lambda *a: None)
    run.model.train()
    built = status_kb("VmRSS") / 1024
    frozen = sum(p.numel() * p.element_size() for p in run.model.parameters() if not p.requires_grad)
    frozen += sum(b.numel() * b.element_size() for b in run.model.buffers())
    lora = sum(p.numel() for pair in run.private.pairs for p in pair.params)
    step = _stepper(run)
    peak = PeakMemory(torch.device("cpu")).start()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    out = peak.read()
    return {"config": name, "rss_before_load_mb": rss0, "rss_after_build_mb": built,
            "peak_step_rss_mb": out["peak_memory_mb"], "measure": out["measure"], "frozen_weights_mb": frozen / 2**20,
            "lora_params": lora, "steps": steps, "seconds": time.perf_counter() - t0}


def estimate(model: dict, weights: str, checkpointing: bool, act_per_token_layer: float, micro: int, length: int,
             rank: int, per_example_copies: float) -> dict:
    """GB of one PRISM step: frozen weights + activations + per-example LoRA state (see the Markdown)."""
    L, h, f, kv = model["layers"], model["hidden"], model["inter"], model["kv"]
    embed = model["vocab"] * h * (1 if model["tied"] else 2)
    frozen = (model["params"] - embed) * WEIGHT_BYTES[weights] + embed * 2  # embeddings / lm_head stay 16-bit
    tokens = micro * length
    if checkpointing:  # block inputs kept (16-bit), one block recomputed at a time
        act = tokens * L * h * 2 + tokens * act_per_token_layer * h
    else:
        act = tokens * L * act_per_token_layer * h
    act += tokens * model["vocab"] * 4 * 2  # float32 logits and their gradient
    lora = L * rank * ((h + h) + 2 * (h + kv) + 2 * (h + f))  # q, k, v, up, down: (m + n) r each
    state = lora * 4 * (per_example_copies + micro)  # float32: the factors' copies + one per-example gradient each
    gb = lambda x: x / 1e9  # noqa: E731
    return {"frozen_gb": gb(frozen), "activations_gb": gb(act), "lora_state_gb": gb(state),
            "total_gb": gb(frozen + act + state)}


def _markdown(rows: list[dict], ext: dict, coeff: dict, env: dict, key: str = "bfloat16 + checkpointing") -> str:
    lines = ["# Peak memory of a PRISM step", "",
             f"{env['date']}, commit {env['commit']}, torch {env['torch']}, {env['machine']}. "
             f"SmolLM2-135M (packaged GGUF), PRISM, LoRA r {RANK} on {'/'.join(TARGETS)}, "
             f"micro-batch {MICRO} x {LENGTH} tokens. CPU peak resident set (VmHWM) over the steps: interpreter "
             "and libraries included.", "",
             "| config | RSS before load (MB) | RSS after build (MB) | peak RSS of the steps (MB) "
             "| frozen weights (MB) | vs float32 |", "|---|---|---|---|---|---|"]
    ref = next((r["peak_step_rss_mb"] for r in rows if r["config"] == "float32"), float("nan"))
    for r in rows:
        lines.append(f"| {r['config']} | {r['rss_before_load_mb']:.0f} | {r['rss_after_build_mb']:.0f} | "
                     f"{r['peak_step_rss_mb']:.0f} | {r['frozen_weights_mb']:.0f} | "
                     f"{r['peak_step_rss_mb'] / ref:.2f} |")
    lines += ["", f"Activation coefficient measured here: {coeff['no_ckpt']:.1f} bytes per token, layer and hidden "
              f"unit without checkpointing ({coeff['from']} run: (peak - after build - logits) / (tokens x layers x "
              "hidden)); " +
              (f"{coeff['ckpt']:.1f} with checkpointing ({key} run)." if coeff["ckpt_measured"] else
               "no checkpointing run measured: the same c assumed for the recomputed block."), "",
              "## Extrapolated (GB per GPU, one micro-batch of 8 x 512 tokens, r 16)", "",
              "total = frozen weights + activations + per-example LoRA state, with P parameters, E embedding and "
              "output-layer parameters (kept 16-bit), L layers, hidden h, T tokens per micro-batch, V vocabulary:", "",
              "- frozen = (P - E) x w + 2 E bytes, w = 2 (bf16), 0.5625 (NF4 + absmax per 64);",
              "- activations = c T L h (no checkpointing) or 2 T L h + c T h (checkpointing) + 8 T V (float32 logits "
              "and their gradient), c measured above;",
              "- LoRA state = 4 (k + b) R bytes, R = sum over LoRA layers of (m + n) r, b = micro-batch (one "
              "per-example gradient each), k = 8 float32 copies of the factors (factors, clipped sum, noise, "
              "optimizer moments and work buffers).", "",
              "| model | base | checkpointing | frozen | activations | LoRA state | total | " + " | ".join(CARDS) + " |",
              "|---|---|---|---|---|---|---|" + "---|" * len(CARDS)]
    for e in ext:
        fits = []
        for cap, gpus in CARDS.values():
            per_gpu = e["total_gb"] - e["frozen_gb"] * (gpus - 1) / gpus  # frozen weights sharded, the rest per GPU
            fits.append(("yes" if per_gpu <= 0.9 * cap else "no") + (f" ({per_gpu:.0f} GB/GPU)" if gpus > 1 else ""))
        lines.append(f"| {e['model']} | {e['weights']} | {'yes' if e['checkpointing'] else 'no'} | "
                     f"{e['frozen_gb']:.1f} | {e['activations_gb']:.1f} | {e['lora_state_gb']:.2f} | "
                     f"{e['total_gb']:.1f} | {' | '.join(fits)} |")
    lines += ["", "A card fits when the total is at most 90 % of it (allocator fragmentation, CUDA context). "
              "With FSDP (--fsdp; a 4-bit base is then held in torchao's NF4, which FSDP shards) the frozen weights "
              "divide by 8 and the rest stays per GPU (the FSDP columns are this formula: FSDP ran on CPU/gloo here, "
              "never on GPUs); `prismdp train --fsdp` reads the whole model into rank 0's host memory alone, in "
              "--dtype (70B in bf16: 141 GB), the other processes receive their shards from it."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--output", default="bench/results/memory")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--rows", nargs="+", help="files of rows printed by --one NAME (one JSON object a line) to tabulate "
                                             "instead of measuring (configurations measured side by side)")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one, args.steps)))
        return 0
    from bench.common import environment, write

    rows = []
    for path in args.rows or ():
        rows += [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith("{")]
    for name in args.configs.split(",") if not args.rows else ():
        proc = subprocess.run([sys.executable, "-m", "bench.memory", "--one", name, "--steps", str(args.steps)],
                              capture_output=True, text=True, timeout=3600, start_new_session=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"configuration {name!r} failed")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    smol = MODELS["SmolLM2-135M"]
    tokens_layers = MICRO * LENGTH * smol["layers"] * smol["hidden"]
    by = {r["config"]: r for r in rows}
    logits = MICRO * LENGTH * smol["vocab"] * 4 * 2 / 2**20
    plain = by.get("bfloat16") or by["float32"]
    c = (plain["peak_step_rss_mb"] - plain["rss_after_build_mb"] - logits) * 2**20 / tokens_layers
    key = "bfloat16 + checkpointing"
    ck = ((by[key]["peak_step_rss_mb"] - by[key]["rss_after_build_mb"] - logits) * 2**20
          - MICRO * LENGTH * smol["layers"] * smol["hidden"] * 2) / (MICRO * LENGTH * smol["hidden"]) \
        if key in by else c
    coeff = {"no_ckpt": c, "ckpt": ck, "from": plain["config"], "ckpt_measured": key in by}
    ext = []
    for model in ("Llama-3.1-8B", "Llama-3.1-70B"):
        for weights in ("bfloat16", "4bit"):
            for ckpt in (False, True):
                e = estimate(MODELS[model], weights, ckpt, ck if ckpt else c, 8, 512, 16, 8)
                ext.append({"model": model, "weights": weights, "checkpointing": ckpt, **e})
    env = environment(2)
    out = Path(args.output)
    write(out / "memory.json", json.dumps({"environment": env, "measured": rows, "coefficients": coeff,
                                            "extrapolated": ext}, indent=2) + "\n")
    write(out / "memory.md", _markdown(rows, ext, coeff, env))
    print((out / "memory.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
