"""Where a PRISM step spends what DP-AdamW's does not: ``torch.profiler`` over a few steps of each variant of a
workload (built as :mod:`bench` builds them), per step: the matrix flops the profiler counts (exact, independent of
machine load), the number of operator calls, the summed self CPU time of every operator, and the operators whose
time or flops differ most from the first variant's.  The compensation of LoRA dropout on the rank-r start
(``prismdp.lora.start.StartDropoutCompensation``) shows as the ``_StartProduct`` function and its backward node (time
including their children).

    PYTHONPATH=src:. python -m bench.profile --workloads W0,W1,W2 --output bench/results/profile

The profiler adds a fixed cost per operator call, so its times overstate small operators; the flops and call counts
are exact, the times a decomposition, not a replacement for :mod:`bench`'s paired step times.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import environment, write
from bench.workloads import WORKLOADS, build_variant

COMP = ("_StartProduct",)  # the started pairs' products with the start's factors (forward and backward nodes)


def _steppers(workload: str, variants: List[str]) -> Dict[str, Callable[[], None]]:
    if workload == "W0":
        from bench.train_job import _build, _stepper

        return {v: _stepper(_build("W0", v)) for v in variants}  # the same seed: the same Poisson batches
    w = WORKLOADS[workload]
    base = w.load()
    return {v: build_variant(v, w, base).step for v in variants}


def _new_ops() -> Dict[str, Dict[str, float]]:
    return defaultdict(lambda: {"self_us": 0.0, "total_us": 0.0, "flops": 0.0, "calls": 0.0})


def profile_step(step: Callable[[], None], ops: Dict[str, Dict[str, float]], scale: float) -> None:
    """Profile one ``step()``; add its per-operator self and total CPU time (us), flops and calls, times ``scale``,
    to ``ops``."""
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        step()
    for e in prof.key_averages():
        o = ops[e.key]
        o["self_us"] += e.self_cpu_time_total * scale
        o["total_us"] += e.cpu_time_total * scale
        o["flops"] += (e.flops or 0) * scale
        o["calls"] += e.count * scale


def summary(ops: Dict[str, Dict[str, float]]) -> dict:
    comp_us = sum(o["total_us"] for k, o in ops.items() if k.startswith(COMP))  # the forward and backward nodes
    return {"self_us": sum(o["self_us"] for o in ops.values()), "flops": sum(o["flops"] for o in ops.values()),
            "calls": sum(o["calls"] for o in ops.values()), "compensation_us": comp_us, "ops": dict(ops)}


def run(workload: str, variants: List[str], steps: int, warmup: int, log=print) -> dict:
    """``warmup`` unprofiled steps, then ``steps`` rounds profiling one step of each variant in turn (so that a
    change of machine load hits every variant alike); per-step averages."""
    t0 = time.perf_counter()
    steppers = _steppers(workload, variants)
    log(f"[profile] {workload}: built {len(variants)} variants in {time.perf_counter() - t0:.1f} s")
    for _ in range(warmup):
        for step in steppers.values():
            step()
    ops = {v: _new_ops() for v in steppers}
    for _ in range(steps):
        for v, step in steppers.items():
            profile_step(step, ops[v], 1 / steps)
    out = {v: summary(o) for v, o in ops.items()}
    for v, r in out.items():
        log(f"[profile] {workload} {v}: {r['self_us'] / 1e6:.3f} s self CPU / step, {r['flops'] / 1e9:.2f} GFLOP, "
            f"{r['calls']:.0f} calls")
    return {"workload": workload, "variants": out}


def _diff_rows(res: dict, ref: str, other: str, top: int) -> List[str]:
    a, b = res["variants"][ref]["ops"], res["variants"][other]["ops"]
    keys = set(a) | set(b)
    zero = {"self_us": 0.0, "flops": 0.0, "calls": 0.0}
    d = sorted(keys, key=lambda k: -abs(b.get(k, zero)["self_us"] - a.get(k, zero)["self_us"]))
    rows = [f"| operator | {ref} self ms | {other} self ms | difference ms | {ref} MFLOP | {other} MFLOP | "
            f"calls {ref} / {other} |", "|---|---:|---:|---:|---:|---:|---:|"]
    for k in d[:top]:
        x, y = a.get(k, zero), b.get(k, zero)
        rows.append(f"| `{k}` | {x['self_us'] / 1e3:.1f} | {y['self_us'] / 1e3:.1f} | "
                    f"{(y['self_us'] - x['self_us']) / 1e3:+.1f} | {x['flops'] / 1e6:.0f} | {y['flops'] / 1e6:.0f} | "
                    f"{x['calls']:.0f} / {y['calls']:.0f} |")
    return rows


def markdown(report: dict, top: int) -> str:
    env = report["environment"]
    lines = ["# Where the PRISM step's time goes: profiler decomposition", "",
             f"{report['date']}, commit {env.get('commit')}, torch {env.get('torch')}, {env.get('threads')} thread(s). "
             f"{report['warmup']} warm-up + {report['steps']} profiled steps per variant (`python -m bench.profile`). "
             "Flops and calls per step are exact; times are the profiler's self CPU time per step (it adds a fixed "
             "cost per call, and machine load inflates them), a decomposition only.", ""]
    for res in report["workloads"]:
        vs = res["variants"]
        ref = report["reference"]
        lines += [f"## {res['workload']}", "",
                  "| variant | self CPU s / step | GFLOP / step | flops / reference | operator calls / step | "
                  "compensation (fwd + bwd, incl. children) ms / step |",
                  "|---|---:|---:|---:|---:|---:|"]
        for v, r in vs.items():
            lines.append(f"| {v} | {r['self_us'] / 1e6:.3f} | {r['flops'] / 1e9:.3f} | "
                         f"{r['flops'] / vs[ref]['flops']:.4f} | {r['calls']:.0f} | {r['compensation_us'] / 1e3:.1f} |")
        for other in vs:
            if other != ref:
                lines += ["", f"Largest differences, {other} against {ref}:", ""] + _diff_rows(res, ref, other, top)
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="W0,W1,W2")
    p.add_argument("--variants", default="dp-adamw,prism,prism-no-dropout-comp",
                   help="the first is the reference of the flop ratios and differences (W0: those of dp-adamw, "
                        "prism, lora-adamw)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--output", default="bench/results/profile")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    variants = [v for v in a.variants.split(",") if v]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "environment": environment(a.threads),
              "steps": a.steps, "warmup": a.warmup, "reference": variants[0], "workloads": []}
    for wl in [w for w in a.workloads.split(",") if w]:
        vs = [v for v in variants if wl != "W0" or v in ("dp-adamw", "prism", "lora-adamw")]
        report["workloads"].append(run(wl, vs, a.steps, a.warmup))
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "profile.json", json.dumps(report, indent=1))
    write(out / "profile.md", markdown(report, a.top))
    print(f"[profile] wrote {out / 'profile.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
