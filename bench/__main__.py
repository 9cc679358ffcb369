"""prismdp benchmarks: ``python -m bench`` (from the repository root, in the project's .venv).

Step time: every variant of :mod:`bench.workloads` on the same workload in one process, interleaved
(A B C D A B C D ...) after warm-up rounds, ``torch.set_num_threads`` fixed; medians, paired per-round ratios, the
share of each private step spent inside the DP mechanism (clip + noise + update), and host synchronisations per
step.  Peak memory: each variant alone in a fresh process (peak RSS of its training steps).  Then the mechanism
micro-benchmark (:mod:`bench.micro`).  Writes ``OUT/bench.json`` and ``OUT/bench.md`` (``--quick``: ``OUT/bench-
quick.*``).

    python -m bench                       # W1 + W2, 3 warm-up + 10 measured rounds, memory, micro (~25 min)
    python -m bench --quick               # 1 + 2 rounds, no memory, micro up to 1024 (~3 min)
    python -m bench --workloads W1 --variants prism,dp-adamw --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from prismdp.train.profile import PeakMemory, status_kb

from .micro import HostSyncCounter, run_micro
from .workloads import ABLATIONS, VARIANTS, WORKLOADS, available_variants, build_variant

RATIOS = [  # (name, numerator, denominator, target by workload)
    ("prism / dp-adamw", "prism", "dp-adamw", {"W1": 1.03, "W2": 1.03}),
    ("prism / prism-no-dropout-comp", "prism", "prism-no-dropout-comp", {}),
    ("prism-secure / prism", "prism-secure", "prism", {}),
    ("dp-adamw-secure / dp-adamw", "dp-adamw-secure", "dp-adamw", {}),
    ("dp-adamw / opacus-dp-adamw", "dp-adamw", "opacus-dp-adamw", {"W1": 1.00, "W2": 1.00}),
    ("prism / lora-adamw", "prism", "lora-adamw", {"W1": 1.15, "W2": 1.10}),
    ("dp-adamw / lora-adamw", "dp-adamw", "lora-adamw", {}),
    ("opacus-dp-adamw / lora-adamw", "opacus-dp-adamw", "lora-adamw", {}),
]
MEMORY_TARGET = 1.05  # prism / dp-adamw peak memory


def _csv(s: str) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def time_steps(workload: str, variants: List[str], steps: int, warmup: int, log=print) -> dict:
    w = WORKLOADS[workload]
    t0 = time.perf_counter()
    base = w.load()
    built = [build_variant(v, w, base) for v in variants]
    log(f"[bench] {workload}: {w.description}; built {len(built)} variants in {time.perf_counter() - t0:.1f} s")
    times: Dict[str, List[float]] = {v.name: [] for v in built}
    mech: Dict[str, List[float]] = {v.name: [] for v in built}
    for rnd in range(warmup + steps):
        for v in built:
            m0 = v.mechanism.seconds if v.mechanism else 0.0
            t = time.perf_counter()
            v.step()
            dt = time.perf_counter() - t
            if rnd >= warmup:
                times[v.name].append(dt)
                mech[v.name].append((v.mechanism.seconds - m0) if v.mechanism else 0.0)
        log(f"[bench] {workload} round {rnd + 1}/{warmup + steps}"
            + (" (warm-up)" if rnd < warmup else "") + ": "
            + ", ".join(f"{v.name} {times[v.name][-1] if rnd >= warmup else dt:.3f}s" for v in built[-1:]))
    syncs, mech_syncs = {}, {}
    for v in built:  # one extra, untimed step under the host-sync counters
        if v.mechanism:
            v.mechanism.count_syncs, v.mechanism.syncs = True, 0
        with HostSyncCounter() as counter:
            v.step()
        syncs[v.name] = counter.count
        if v.mechanism:
            mech_syncs[v.name], v.mechanism.count_syncs = v.mechanism.syncs, False
    res = {"workload": workload, "description": w.description, "variants": {}}
    for v in built:
        ts = times[v.name]
        res["variants"][v.name] = {
            "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "times_s": ts,
            "mechanism_median_s": statistics.median(mech[v.name]) if v.mechanism else None,
            "mechanism_share": statistics.median(m / t for m, t in zip(mech[v.name], ts)) if v.mechanism else None,
            "host_syncs_per_step": syncs[v.name], "mechanism_host_syncs_per_step": mech_syncs.get(v.name)}
    res["ratios"] = {}
    for name, a, b, targets in RATIOS:
        if a in times and b in times:
            paired = [x / y for x, y in zip(times[a], times[b])]
            res["ratios"][name] = {"paired_median": statistics.median(paired),
                                   "ratio_of_medians": statistics.median(times[a]) / statistics.median(times[b]),
                                   "target": targets.get(workload)}
    return res


def _memory_child(workload: str, variant: str, steps: int) -> dict:
    """Runs in its own process: peak RSS over ``steps`` training steps after one warm-up step."""
    w = WORKLOADS[workload]
    v = build_variant(variant, w, w.load())
    v.step()
    peak = PeakMemory("cpu").start()
    rss0 = status_kb("VmRSS")
    for _ in range(steps):
        v.step()
    got = peak.read()
    return {"peak_rss_mb": got["peak_memory_mb"], "rss_before_steps_mb": rss0 / 1024, "method": got["measure"]}


def measure_memory(workload: str, variants: List[str], threads: int, steps: int, log=print) -> dict:
    out = {}
    for v in variants:
        cmd = [sys.executable, "-m", "bench", "--memory-child", workload, v, "--threads", str(threads),
               "--steps", str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if proc.returncode != 0:
            raise RuntimeError(f"memory run {workload}/{v} failed:\n{proc.stderr[-3000:]}")
        out[v] = json.loads(proc.stdout.strip().splitlines()[-1])
        log(f"[bench] {workload} memory {v}: peak {out[v]['peak_rss_mb']:.0f} MB")
    if "prism" in out and "dp-adamw" in out:
        out["prism / dp-adamw"] = {"ratio": out["prism"]["peak_rss_mb"] / out["dp-adamw"]["peak_rss_mb"],
                                   "target": MEMORY_TARGET}
    return out


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# prismdp benchmark{' (quick)' if report['quick'] else ''}", "",
             f"{env['date']}, commit {env['commit']}, torch {env['torch']}, {env['threads']} thread(s), "
             f"{env['cpus']} CPU(s), {env['machine']}. Warm-up {report['warmup']} + {report['steps']} measured "
             "rounds per workload, variants interleaved in one process; ratios are medians of per-round ratios.", ""]
    for res in report["workloads"]:
        wl = res["workload"]
        lines += [f"## {wl}: {res['description']}", "",
                  "| variant | median step (s) | min-max (s) | mechanism share | host syncs / step (in mechanism) |",
                  "|---|---:|---:|---:|---:|"]
        for name, v in res["variants"].items():
            share = None if v["mechanism_share"] is None else 100 * v["mechanism_share"]
            lines.append(f"| {name} | {v['median_s']:.3f} | {v['min_s']:.3f}-{v['max_s']:.3f} | "
                         f"{_fmt(share, '.1f')}{'' if share is None else ' %'} | {v['host_syncs_per_step']} "
                         f"({_fmt(v['mechanism_host_syncs_per_step'], 'd')}) |")
        lines += ["", "| ratio | measured | target |", "|---|---:|---:|"]
        for name, r in res["ratios"].items():
            ok = "" if r["target"] is None else (" (met)" if r["paired_median"] <= r["target"] else " (missed)")
            lines.append(f"| {name} | {r['paired_median']:.3f} | {_fmt(r['target'], '.2f')}{ok} |")
        mem = report.get("memory", {}).get(wl)
        if mem:
            lines += ["", "| variant | peak RSS during steps (MB) |", "|---|---:|"]
            lines += [f"| {k} | {v['peak_rss_mb']:.0f} |" for k, v in mem.items() if "peak_rss_mb" in v]
            if "prism / dp-adamw" in mem:
                r = mem["prism / dp-adamw"]
                lines.append(f"\nPeak memory prism / dp-adamw: {r['ratio']:.3f} (target <= {r['target']:.2f}).")
        lines.append("")
    micro = report.get("micro")
    if micro:
        lines += ["## Mechanism micro-benchmark (one module, b = 64, r = 16)", "",
                  "| m = n | PRISM step (ms) | dense reference (ms) | dense / PRISM | host syncs |",
                  "|---:|---:|---:|---:|---:|"]
        for row in micro["rows"]:
            dense = row.get("dense_median_s")
            lines.append(f"| {row['m']} | {1e3 * row['prism_median_s']:.2f} | "
                         f"{'skipped' if dense is None else f'{1e3 * dense:.1f}'} | "
                         f"{'-' if dense is None else format(row['dense_over_prism'], '.0f') + 'x'} | "
                         f"{row['host_syncs_per_step']} |")
        if micro.get("prism_8192_over_1024") is not None:
            lines.append(f"\nPRISM math at m = n = 8192 / at 1024: {micro['prism_8192_over_1024']:.2f} (target <= 10).")
    return "\n".join(lines) + "\n"


def _environment(threads: int) -> dict:
    try:
        here = Path(__file__).resolve().parent
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=here).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src", "bench"],
                               capture_output=True, text=True, cwd=here).stdout.strip()
        commit += " + uncommitted changes" if dirty else ""
    except OSError:
        commit = "unknown"
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "torch": torch.__version__, "threads": threads, "cpus": os.cpu_count(),
            "machine": f"{platform.machine()} {platform.processor() or platform.system()}"}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", type=_csv, default=["W1", "W2"], help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--variants", type=_csv, default=list(VARIANTS),
                   help=f"of {', '.join(available_variants())} (default: {', '.join(VARIANTS)}; the ablation "
                        f"{', '.join(ABLATIONS)} is opt-in)")
    p.add_argument("--steps", type=int, default=10, help="measured rounds (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up rounds (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--quick", action="store_true", help="1 warm-up + 2 rounds, no memory runs, micro up to 1024")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory processes")
    p.add_argument("--micro-sizes", type=lambda s: [int(x) for x in _csv(s)], default=None,
                   help="m = n sizes of the micro-benchmark (default 256,...,8192; empty: skip)")
    p.add_argument("--output", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    unknown = [w for w in args.workloads if w not in WORKLOADS] + \
        [v for v in args.variants if v not in available_variants()]
    if unknown:
        p.error(f"unknown workload/variant {unknown}; workloads {list(WORKLOADS)}, "
                f"variants {list(available_variants())}")
    if args.memory_child:
        print(json.dumps(_memory_child(*args.memory_child, steps=max(1, min(args.steps, 2)))))
        return 0
    if args.quick:
        args.steps, args.warmup, args.no_memory = 2, 1, True
    sizes = args.micro_sizes if args.micro_sizes is not None else (
        [256, 512, 1024] if args.quick else [256, 512, 1024, 2048, 4096, 8192])
    report = {"quick": args.quick, "steps": args.steps, "warmup": args.warmup,
              "environment": _environment(args.threads), "workloads": [], "memory": {}}
    for wl in args.workloads:
        report["workloads"].append(time_steps(wl, args.variants, args.steps, args.warmup))
        if not args.no_memory:
            report["memory"][wl] = measure_memory(wl, args.variants, args.threads, args.steps)
    if sizes:
        report["micro"] = run_micro(sizes, steps=2 if args.quick else 5, dense_max=1024 if args.quick else 4096)
    out = Path(args.output)
    stem = "bench-quick" if args.quick else "bench"
    _write(out / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    _write(out / f"{stem}.md", md)
    print(md)
    print(f"[bench] wrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
