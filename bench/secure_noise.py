"""What ``--secure-noise`` costs per step, measured where it acts: the noise of one release and one Poisson sample.

For each workload and method, the exact shapes the mechanism draws noise for (``coords.zeros()`` of the private
optimizer: PRISM's lift-space draws, DP-AdamW's one coordinate per trained parameter) are filled with standard normals
by the default source (``torch.randn``, Mersenne Twister) and by the secure one (ChaCha20 + four float64 normals per
coordinate, :class:`prismdp.privacy.secure.SecureRandom`), interleaved round by round; likewise the dataset's Poisson
inclusion uniforms.  The full-step ratio comes from ``python -m bench --variants prism,prism-secure,...``; this
isolates the part that changes, which is far less noisy on a shared machine.

    python -m bench.secure_noise --workloads W1,W2 --rounds 20 --output bench/results/secure-noise
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from prismdp.privacy.secure import SecureRandom, TorchNoise

from .workloads import WORKLOADS, _peft


def _shapes(workload: str, method: str) -> list[tuple[torch.Size, torch.dtype]]:
    from prismdp.engine import make_private

    w = WORKLOADS[workload]
    model = _peft(w.load(), w)
    private = make_private(model, method=method, lr=1e-4, dataset_size=10 * w.batch, batch_size=w.batch,
                           steps=10 ** 6, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    opt = private.optimizer
    coords = opt._coordinates() if method == "prism" else opt.coords  # the release's noise shapes
    return [(z.shape, z.dtype) for z in coords.zeros()]


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(workload: str, method: str, rounds: int, dataset: int) -> dict:
    shapes = _shapes(workload, method)
    default, secure = TorchNoise(torch.Generator().manual_seed(0)), SecureRandom()
    draw = {"default": lambda: [default.normal(s, d, "cpu") for s, d in shapes],
            "secure": lambda: [secure.normal(s, d, "cpu") for s, d in shapes]}
    sample = {"default": lambda: torch.rand(dataset, generator=default.generator, dtype=torch.float64),
              "secure": lambda: secure.uniform(dataset)}
    for f in (*draw.values(), *sample.values()):
        f()  # warm-up
    t = {k: [] for k in ("noise_default", "noise_secure", "sample_default", "sample_secure")}
    for _ in range(rounds):
        for k in ("default", "secure"):
            t[f"noise_{k}"].append(_time(draw[k]))
            t[f"sample_{k}"].append(_time(sample[k]))
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"workload": workload, "method": method, "coordinates": sum(s.numel() for s, _ in shapes),
            "dataset": dataset, "median_s": med,
            "added_s_per_step": med["noise_secure"] - med["noise_default"] + med["sample_secure"] - med["sample_default"],
            "noise_ratio_paired": statistics.median(a / b for a, b in zip(t["noise_secure"], t["noise_default"]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--methods", default="prism,dp-adamw")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--dataset", type=int, default=100_000, help="examples whose Poisson inclusion is drawn per step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default="bench/results/secure-noise")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = [measure(w, m, a.rounds, a.dataset) for w in a.workloads.split(",") for m in a.methods.split(",")]
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise.json").write_text(json.dumps({"rounds": a.rounds, "threads": a.threads, "rows": rows}, indent=2))
    lines = [f"# Secure noise: the draws of one step ({a.rounds} interleaved rounds, {a.threads} thread(s))", "",
             "| workload | method | noise coordinates | torch.randn (ms) | secure (ms) | paired ratio | "
             f"Poisson uniforms for {a.dataset} examples: torch / secure (ms) | added per step (ms) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["median_s"]
        lines.append(f"| {r['workload']} | {r['method']} | {r['coordinates']:,} | {1e3 * m['noise_default']:.2f} | "
                     f"{1e3 * m['noise_secure']:.2f} | {r['noise_ratio_paired']:.1f} | {1e3 * m['sample_default']:.2f}"
                     f" / {1e3 * m['sample_secure']:.2f} | {1e3 * r['added_s_per_step']:.1f} |")
    (out / "noise.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
