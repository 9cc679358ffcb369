"""Where the GPU benchmark's variants spend their step: ``torch.profiler`` (CPU and CUDA activity) over a few logical
steps of each variant of :mod:`bench.gpu_variants` on one shape and micro-batch size, after warm-up steps.

Per variant: the wall time of the profiled steps (CUDA-synchronised), the summed CUDA kernel time (the GPU busy
time), wall minus kernel time (where the GPU waits for the host; issue 44's target: at most 5 ms per PRISM step), the
number of kernels launched, the synchronising calls of one unprofiled step (CUDA's sync debug mode; at most 3 per
PRISM step) and its tensor reads to the host (:class:`bench.micro.HostSyncCounter`, also on the CPU), and the
operators with the most self CUDA time.  Beside the first variant (the PEFT reference), the operators whose CUDA time differs most
from it: what a variant pays that the reference does not.

    python -m bench.gpu_profile                                   # llama-3.2-1b, micro-batch 32, six variants
    python -m bench.gpu_profile --shape gemma-3-4b --micro 16 --variants reference,no-dp
    python -m bench.gpu_profile --shape tiny-llama --device cpu   # a check of the script (CPU times only)

Writes ``OUT/gpu-profile-<device>.json`` and ``.md``.  The profiler adds a cost per operator call on the host, so
wall times here are above the benchmark's; kernel times and counts are what the GPU did.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from .gpu import _sync, _write, counted_step, environment, refuse, resolve_device
from .gpu_models import SHAPES, build_base, sanitize
from .gpu_variants import VARIANTS, batch, build_variant


OVERHEAD = {"Command Buffer Full", "Activity Buffer Request", "Buffer Flush"}  # the profiler's own records


def _kind(event) -> str | None:
    """``kernel`` (work on the GPU: kernels, copies, fills), ``op`` (an operator called on the host), or None (the
    profiler's own records and the GPU spans of user annotations, which would count their kernels twice)."""
    if event.name in OVERHEAD:
        return None
    if event.device_type == torch.autograd.DeviceType.CUDA:
        return None if getattr(event, "is_user_annotation", False) else "kernel"
    return "op"


HOST_GAP_TARGET_S, CUDA_SYNCS_TARGET = 0.005, 3  # per PRISM step (issue 44)


def profile_variant(variant, micro: int, device: torch.device, steps: int, warmup: int) -> dict:
    for _ in range(warmup):
        variant.step(micro)
    _sync(device)
    _, host_syncs, cuda_syncs = counted_step(lambda: variant.step(micro), device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            variant.step(micro)
        _sync(device)
        wall = time.perf_counter() - start
    variant.check_shared()
    ops = {"op": defaultdict(lambda: {"device_us": 0.0, "cpu_us": 0.0, "calls": 0.0}),
           "kernel": defaultdict(lambda: {"device_us": 0.0, "calls": 0.0})}
    for e in prof.events():
        kind = _kind(e)
        if kind is None:
            continue
        rec = ops[kind][e.name]
        rec["calls"] += 1 / steps
        if kind == "kernel":
            rec["device_us"] += e.device_time_total / steps
        else:
            rec["device_us"] += e.self_device_time_total / steps
            rec["cpu_us"] += e.self_cpu_time_total / steps
    kernels = ops["kernel"].values()
    busy = sum(k["device_us"] for k in kernels) / 1e6
    return {"wall_s": wall / steps, "device_busy_s": busy, "kernels": sum(k["calls"] for k in kernels),
            "wall_minus_kernel_s": wall / steps - busy if device.type == "cuda" else None,
            "host_syncs_per_step": host_syncs, "cuda_syncs_per_step": cuda_syncs,
            "ops": dict(ops["op"]), "kernel_ops": dict(ops["kernel"])}


def _table(title: str, rows: dict, key: str, top: int, ref: dict | None = None) -> list[str]:
    unit = "CUDA" if key == "device_us" else "CPU"
    if ref is None:
        out = ["", f"## {title}: top by self {unit} time per step", "", "| name | ms | calls |", "|---|---:|---:|"]
        for name, o in sorted(rows.items(), key=lambda kv: -kv[1][key])[:top]:
            out.append(f"| `{name[:120]}` | {o[key] / 1e3:.2f} | {o['calls']:.0f} |")
        return out
    diff = {n: rows.get(n, {}).get(key, 0.0) - ref.get(n, {}).get(key, 0.0) for n in set(rows) | set(ref)}
    out = ["", f"## {title}: by difference of self {unit} time per step", "",
           "| name | ms more | calls (this / reference) |", "|---|---:|---:|"]
    for name, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
        out.append(f"| `{name[:120]}` | {d / 1e3:+.2f} | {rows.get(name, {}).get('calls', 0):.0f} / "
                   f"{ref.get(name, {}).get('calls', 0):.0f} |")
    return out


def markdown(report: dict, top: int) -> str:
    env = report["environment"]
    lines = [f"# GPU profile: {env['device_name']}", "",
             f"{env['date']}, commit {env['commit']}; torch {env['versions']['torch']}, transformers "
             f"{env['versions']['transformers']}, peft {env['versions']['peft']}.",
             f"Command: `{' '.join(report['command'])}`. Shape {report['shape']}, micro-batch {report['micro']}, "
             f"per logical step: {report['steps']} profiled after {report['warmup']} warm-up.", "",
             "Wall minus kernel time (the time the GPU waits for the host; the profiler's own host cost included, so "
             "an upper bound) and synchronising CUDA calls per step (one unprofiled step under "
             "`torch.cuda.set_sync_debug_mode`) against issue 44's targets for PRISM: at most "
             f"{HOST_GAP_TARGET_S * 1e3:.0f} ms and {CUDA_SYNCS_TARGET}. Host reads: tensor reads to the host "
             "and factorisations that read their status on CUDA "
             "(`bench.micro.HostSyncCounter`, the CPU's proxy for the synchronising calls).", "",
             "| variant | wall (s) | GPU busy (s) | busy / wall | wall - kernels (ms) | kernels | CUDA syncs | "
             "host reads |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in report["variants"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:80]} | | | | | | |")
            continue
        gap, syncs = r.get("wall_minus_kernel_s"), r.get("cuda_syncs_per_step")
        lines.append(f"| {name} | {r['wall_s']:.3f} | {r['device_busy_s']:.3f} | "
                     f"{r['device_busy_s'] / r['wall_s']:.2f} | {'-' if gap is None else f'{gap * 1e3:.1f}'} | "
                     f"{r['kernels']:.0f} | {'-' if syncs is None else syncs} | {r.get('host_syncs_per_step', '-')} |")
    names = [n for n, r in report["variants"].items() if "error" not in r]
    key = "device_us" if any(report["variants"][n]["kernels"] for n in names) else "cpu_us"
    for name in names:
        lines += _table(f"{name}, operators", report["variants"][name]["ops"], key, top)
        if key == "device_us":
            lines += _table(f"{name}, kernels", report["variants"][name]["kernel_ops"], key, top)
    for name in names[1:]:
        lines += _table(f"{name} minus {names[0]}, operators", report["variants"][name]["ops"], key, top,
                        ref=report["variants"][names[0]]["ops"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--micro", type=int, default=None, help="micro-batch size (default: the shape's largest)")
    p.add_argument("--variants", default="reference,no-dp,dp-adamw,prism,prism-tf32-products,prism-secure")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--device", default=None, help="default cuda if available, else cpu")
    p.add_argument("--output", default="bench/results")
    args = p.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        return refuse("python -m bench.gpu_profile", e)
    shape = SHAPES[args.shape]
    micro = args.micro or max(m for m in shape.micro_sizes if shape.batch % m == 0)
    env = environment(device)
    report = {"command": ["python", "-m", "bench.gpu_profile", *(sys.argv[1:] if argv is None else argv)],
              "environment": env, "shape": shape.name, "micro": micro, "steps": args.steps, "warmup": args.warmup,
              "variants": {}}
    out = Path(args.output)
    stem = out / f"gpu-profile-{sanitize(env['device_name'])}"
    base = build_base(shape, device)
    ids = batch(shape, base.config.vocab_size, device)
    for name in names:
        try:
            variant = build_variant(name, shape, base, ids)
            report["variants"][name] = profile_variant(variant, micro, device, args.steps, args.warmup)
            variant.release()
            del variant
        except Exception as e:  # noqa: BLE001 -- recorded; the next variant still runs
            report["variants"][name] = {"error": f"{type(e).__name__}: {e}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = report["variants"][name]
        print(f"[gpu_profile] {name}: " + (r["error"] if "error" in r else
              f"wall {r['wall_s']:.3f} s, GPU busy {r['device_busy_s']:.3f} s, {r['kernels']:.0f} kernels"),
              flush=True)
        _write(stem.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
        _write(stem.with_suffix(".md"), markdown(report, args.top))
    print(markdown(report, args.top))
    return sum("error" in r for r in report["variants"].values())


if __name__ == "__main__":
    sys.exit(main())
