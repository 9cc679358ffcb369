"""What ``--secure-noise`` costs per step, measured where it acts: the noise of one release and one Poisson sample.

For each workload and method, the exact shapes the mechanism draws noise for (``coords.zeros()`` of the private
optimizer: PRISM's lift-space draws, DP-AdamW's one coordinate per trained parameter) are filled with standard normals
by the default source (``torch.randn``, Mersenne Twister) and by the secure one (ChaCha20 + four float64 normals per
coordinate, :class:`prismdp.privacy.secure.SecureRandom`), interleaved round by round; likewise the dataset's Poisson
inclusion uniforms.  The full-step ratio comes from ``python -m bench --variants prism,prism-secure,...``; this
isolates the part that changes, which is far less noisy on a shared machine.

    python -m bench.studies.secure_noise --workloads W1,W2 --rounds 20 --output bench/results/secure-noise

On a GPU (issue 30) the default noise is drawn on the device by torch's CUDA generator (Philox); secure noise is drawn
on the CPU (ChaCha20 has no GPU kernel in randomgen), summed and cast to float32 there into page-locked memory and
copied to the device asynchronously.  The CPU part is what this measures (the ``secure`` column); the copy is an
*estimate* from the bytes and an assumed host-to-device bandwidth (``--h2d-gbps``, not measured here).  The workload
``llama-3.2-1b-r16`` gives the noise shapes of LoRA r 16 on q/k/v/up/down of Llama-3.2-1B, written out from its
dimensions (no model is built):

    python -m bench.studies.secure_noise --workloads llama-3.2-1b-r16 --rounds 5 \
        --output bench/results/secure-noise/gpu-shapes

Secure noise is drawn off the critical path (``SecureRandom(background=True)``, the default): a release takes the
noise drawn on a background thread while the step ran.  The ``background`` column is the time a release waits for
its noise when the step (here: a wait for the background draw, untimed) lasted at least as long as the draw: the
critical path's cost where the step covers the draw.  Where it does not (a step shorter than the draw, or fewer
free cores than noise threads), the release waits for the rest of the draw.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from prismdp.privacy.secure import SecureRandom, TorchNoise

from ..workloads import WORKLOADS, _peft


#: Llama-3.2-1B: 16 layers, hidden 2048, MLP 8192, 8 KV heads of 64; each LoRA target as (out m, in n)
LLAMA_1B_TARGETS = {"q_proj": (2048, 2048), "k_proj": (512, 2048), "v_proj": (512, 2048), "up_proj": (8192, 2048),
                    "down_proj": (2048, 8192)}
SHAPE_WORKLOADS = {"llama-3.2-1b-r16": (LLAMA_1B_TARGETS, 16, 16)}  # (targets, layers, rank)


def _written_out_shapes(workload: str, method: str) -> list[tuple[torch.Size, torch.dtype]]:
    """The release's float32 noise shapes without building the model: PRISM's per stack of equal-shape modules
    (k, m, r) and (k, n, r) (``_TangentCoordinates.zeros``), DP-AdamW's per module lora_B (m, r) and lora_A (r, n);
    either way r (m + n) coordinates per module."""
    targets, layers, r = SHAPE_WORKLOADS[workload]
    if method == "prism":
        stacks: dict[tuple[int, int], int] = {}
        for m, n in targets.values():
            stacks[(m, n)] = stacks.get((m, n), 0) + layers
        return [(torch.Size(s), torch.float32) for (m, n), k in stacks.items() for s in ((k, m, r), (k, n, r))]
    return [(torch.Size(s), torch.float32) for _ in range(layers) for m, n in targets.values()
            for s in ((m, r), (r, n))]


def _shapes(workload: str, method: str) -> list[tuple[torch.Size, torch.dtype]]:
    from prismdp.engine import make_private

    if workload in SHAPE_WORKLOADS:
        return _written_out_shapes(workload, method)

    w = WORKLOADS[workload]
    model = _peft(w.load(), w)
    private = make_private(model, method=method, lr=1e-4, dataset_size=10 * w.batch, batch_size=w.batch,
                           steps=10 ** 6, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    opt = private.optimizer
    coords = opt._coordinates() if method == "prism" else opt.coords  # the release's noise shapes
    return [(z.shape, z.dtype) for z in coords.zeros()]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time (a shared machine)


def _time(fn, clock=time.perf_counter) -> float:
    t = clock()
    fn()
    return clock() - t


def measure(workload: str, method: str, rounds: int, dataset: int, h2d_gbps: float = 25.0, clock: str = "wall") -> dict:
    shapes = _shapes(workload, method)
    default, secure = TorchNoise(torch.Generator().manual_seed(0)), SecureRandom(background=False)
    ahead = SecureRandom(background=True)
    specs = [(s, d, "cpu") for s, d in shapes]

    def background():  # the step: untimed, at least as long as the background draw
        if ahead._pending is not None:
            ahead._pending[1].result()

    draw = {"default": lambda: default.normals(specs), "secure": lambda: secure.normals(specs),
            "background": lambda: ahead.normals(specs)}
    sample = {"default": lambda: torch.rand(dataset, generator=default.generator, dtype=torch.float64),
              "secure": lambda: secure.uniform(dataset)}
    for f in (*draw.values(), *sample.values()):
        f()  # warm-up
    background()
    t = {k: [] for k in ("noise_default", "noise_secure", "noise_background", "sample_default", "sample_secure")}
    for _ in range(rounds):
        background()  # (also keeps the background thread off the other columns' clocks)
        for k in ("default", "secure"):
            t[f"noise_{k}"].append(_time(draw[k], CLOCKS[clock]))
            t[f"sample_{k}"].append(_time(sample[k], CLOCKS[clock]))
        t["noise_background"].append(_time(draw["background"], time.perf_counter))  # wall: the wait
    med = {k: statistics.median(v) for k, v in t.items()}
    nbytes = sum(s.numel() * torch.finfo(d).bits // 8 for s, d in shapes)
    return {"workload": workload, "method": method, "coordinates": sum(s.numel() for s, _ in shapes),
            "dataset": dataset, "median_s": med, "tensors": len(shapes), "h2d_bytes": nbytes,
            "h2d_estimate_s": {"value": nbytes / (h2d_gbps * 1e9), "assumed_gbps": h2d_gbps,
                               "measured": False},
            "added_s_per_step": med["noise_secure"] - med["noise_default"] + med["sample_secure"] - med["sample_default"],
            "added_s_per_step_background": med["noise_background"] - med["noise_default"] + med["sample_secure"]
            - med["sample_default"],
            "noise_ratio_paired": statistics.median(a / b for a, b in zip(t["noise_secure"], t["noise_default"]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--methods", default="prism,dp-adamw")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--dataset", type=int, default=100_000, help="examples whose Poisson inclusion is drawn per step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall (default) or cpu: this process's CPU time, less disturbed by other work on a shared "
                        "machine (use with --threads 1)")
    p.add_argument("--h2d-gbps", type=float, default=25.0,
                   help="assumed pinned host-to-device bandwidth in GB/s for the copy estimate (default 25: PCIe 4.0 "
                        "x16 in practice; PCIe 5.0 x16, as on H100/H200 SXM hosts, about 50; not measured)")
    p.add_argument("--output", default="bench/results/secure-noise")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = [measure(w, m, a.rounds, a.dataset, a.h2d_gbps, a.clock) for w in a.workloads.split(",")
            for m in a.methods.split(",")]
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise.json").write_text(json.dumps({"rounds": a.rounds, "threads": a.threads, "clock": a.clock,
                                                "h2d_gbps": a.h2d_gbps, "load_average": os.getloadavg(),
                                                "torch": torch.__version__, "rows": rows}, indent=2))
    lines = [f"# Secure noise: the draws of one step ({a.rounds} interleaved rounds, {a.threads} thread(s), "
             f"{a.clock} clock, CPU; load average at the end {os.getloadavg()[0]:.1f})", "",
             "| workload | method | noise coordinates | torch.randn (ms) | secure (ms) | paired ratio | "
             "secure, drawn in the background: the release's wait (ms, wall) | "
             f"Poisson uniforms for {a.dataset} examples: torch / secure (ms) | added per step (ms): foreground / "
             f"background | on a GPU: copy of the float32 noise, estimate at {a.h2d_gbps:g} GB/s, not measured (ms) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["median_s"]
        lines.append(f"| {r['workload']} | {r['method']} | {r['coordinates']:,} | {1e3 * m['noise_default']:.2f} | "
                     f"{1e3 * m['noise_secure']:.2f} | {r['noise_ratio_paired']:.1f} | {1e3 * m['noise_background']:.2f} "
                     f"| {1e3 * m['sample_default']:.2f} / {1e3 * m['sample_secure']:.2f} | "
                     f"{1e3 * r['added_s_per_step']:.1f} / {1e3 * r['added_s_per_step_background']:.1f} | "
                     f"{1e3 * r['h2d_estimate_s']['value']:.2f} ({r['tensors']} copies) |")
    lines += ["", "On a GPU the default noise is drawn there (torch's Philox) and costs no CPU time; secure noise costs "
              "the `secure` column on the CPU (ChaCha20, four float64 normals per coordinate, cast to float32) plus "
              "the asynchronous copy, estimated from its bytes at the assumed bandwidth (not measured on a GPU)."]
    (out / "noise.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
