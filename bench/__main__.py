"""prismdp benchmarks: ``python -m bench`` (from the repository root, in the project's .venv).

Step time: every variant of :mod:`bench.workloads` on the same workload in one process, interleaved micro-batch by
micro-batch (the first micro-batch of A B C D, the second of B C D A, ..., then the updates; ``--interleave step``:
whole steps A B C D) after warm-up rounds, ``torch.set_num_threads`` fixed; medians, paired per-round ratios, the
share of each private step spent inside the DP mechanism (clip + noise + update), and host synchronisations per
step.  W0 is ``prismdp train``'s default job, its methods built by the trainer and stepped the same way
(:mod:`bench.train_job`).  Peak memory: each variant alone in a fresh process (peak RSS of its training steps).
Train / bench: ``prismdp train``'s wall time per step against the bench's step on the same job and batches.  Then
the mechanism micro-benchmark (:mod:`bench.micro`) and the extrapolation to Gemma-3-4B (:mod:`bench.extrapolate`).
Writes ``OUT/bench.json`` and ``OUT/bench.md`` (``--quick``: ``OUT/bench-quick.*``).

    python -m bench                       # W0 + W1 + W2, 3 warm-up + 10 measured rounds, memory, train / bench, micro
    python -m bench --quick               # W1 + W2, 1 + 2 rounds, no memory, no train / bench, micro up to 1024
    python -m bench --workloads W1 --variants prism,dp-adamw --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from prismdp.train.profile import PeakMemory, status_kb

from . import extrapolate as extrap
from . import train_job
from .common import environment, interleaved_round, write
from .micro import HostSyncCounter, run_micro
from .workloads import ABLATIONS, CLOCKS, VARIANTS, WORKLOADS, available_variants, build_variant

RATIOS = [  # (name, numerator, denominator, target by workload): issue 17's targets
    ("prism / dp-adamw", "prism", "dp-adamw", {"W0": 1.03, "W1": 1.03, "W2": 1.03}),
    ("dp-adamw / lora-adamw", "dp-adamw", "lora-adamw", {"W1": 1.05, "W2": 1.05}),
    ("prism / lora-adamw", "prism", "lora-adamw", {"W1": 1.08, "W2": 1.08}),
    ("prism / prism-no-dropout-comp", "prism", "prism-no-dropout-comp", {}),
    ("prism-secure / prism", "prism-secure", "prism", {}),
    ("dp-adamw-secure / dp-adamw", "dp-adamw-secure", "dp-adamw", {}),
    ("dp-adamw / opacus-dp-adamw", "dp-adamw", "opacus-dp-adamw", {"W1": 1.00, "W2": 1.00}),
    ("opacus-dp-adamw / lora-adamw", "opacus-dp-adamw", "lora-adamw", {}),
    # issue 30: against plain PEFT with the model's own loss (labels=)
    ("prism / lora-adamw-own-loss", "prism", "lora-adamw-own-loss", {"W2": 1.10}),
    ("lora-adamw / lora-adamw-own-loss", "lora-adamw", "lora-adamw-own-loss", {}),
]
MEMORY_RATIOS = [("prism / lora-adamw", "prism", "lora-adamw", 1.05), ("prism / dp-adamw", "prism", "dp-adamw", 1.05)]
TRAIN_JOBS = ("W0", "W1", "W2")


def _csv(s: str) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def time_steps(workload: str, variants: List[str], steps: int, warmup: int, log=print, clock=time.perf_counter,
               interleave: str = "micro") -> dict:
    w = WORKLOADS[workload]
    t0 = time.perf_counter()
    base = w.load()
    built = [build_variant(v, w, base, clock=clock) for v in variants]
    log(f"[bench] {workload}: {w.description}; built {len(built)} variants in {time.perf_counter() - t0:.1f} s")
    times: Dict[str, List[float]] = {v.name: [] for v in built}
    mech: Dict[str, List[float]] = {v.name: [] for v in built}
    for rnd in range(warmup + steps):
        m0 = {v.name: v.mechanism.seconds if v.mechanism else 0.0 for v in built}
        took = interleaved_round({v.name: v.parts for v in built}, clock, interleave)
        for v in built:
            dt = took[v.name]
            if rnd >= warmup:
                times[v.name].append(dt)
                mech[v.name].append((v.mechanism.seconds - m0[v.name]) if v.mechanism else 0.0)
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
    mech = {v.name: mech[v.name] if v.mechanism else None for v in built}
    return summarize(workload, w.description, times, mech, syncs, mech_syncs)


def summarize(workload: str, description: str, times: Dict[str, List[float]], mech=None, syncs=None,
              mech_syncs=None) -> dict:
    """Medians, mechanism shares and the paired per-round ratios of one workload's interleaved step times."""
    mech, syncs, mech_syncs = mech or {}, syncs or {}, mech_syncs or {}
    res = {"workload": workload, "description": description, "variants": {}}
    for name, ts in times.items():
        m = mech.get(name)
        res["variants"][name] = {
            "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "times_s": ts,
            "mechanism_median_s": statistics.median(m) if m else None,
            "mechanism_share": statistics.median(a / t for a, t in zip(m, ts)) if m else None,
            "host_syncs_per_step": syncs.get(name), "mechanism_host_syncs_per_step": mech_syncs.get(name)}
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
    for name, a, b, target in MEMORY_RATIOS:
        if a in out and b in out:
            out[name] = {"ratio": out[a]["peak_rss_mb"] / out[b]["peak_rss_mb"], "target": target}
    return out


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def targets_table(report: dict) -> List[str]:
    """Issue 17's targets, one row per ratio and workload, as measured in this run."""
    rows = []
    for res in report["workloads"]:
        for name, r in res["ratios"].items():
            if r["target"] is not None:
                rows.append((f"{name} step time", res["workload"], r["paired_median"], r["target"]))
    for wl, mem in report.get("memory", {}).items():
        for name, _, _, _ in MEMORY_RATIOS:
            if name in mem:
                rows.append((f"{name} peak memory", wl, mem[name]["ratio"], mem[name]["target"]))
    for tb in report.get("train_vs_bench", []):
        rows.append(("prismdp train wall time per step / bench's prism step", tb["job"], tb["paired_median"],
                     tb["target"]))
    if not rows:
        return []
    lines = ["## Targets (issue 17)", "", "| ratio | workload | measured | target | |", "|---|---|---:|---:|---|"]
    for name, wl, got, target in rows:
        lines.append(f"| {name} | {wl} | {got:.3f} | <= {target:.2f} | {'met' if got <= target else 'missed'} |")
    return lines + [""]


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# prismdp benchmark{' (quick)' if report['quick'] else ''}", "",
             f"{env['date']}, commit {env['commit']}, torch {env['torch']}, {env['threads']} thread(s), "
             f"{env['cpus']} CPU(s), {env['machine']}. Warm-up {report['warmup']} + {report['steps']} measured "
             "rounds per workload, variants interleaved in one process "
             + ("micro-batch by micro-batch" if report.get("interleave", "step") == "micro" else "step by step")
             + "; ratios are medians of per-round ratios"
             + ("; step and mechanism times are the process's CPU time." if report.get("clock") == "cpu" else ".")]
    load = env.get("load")
    if load:
        lines.append(f"Machine load (1-minute load average, {env['cpus']} CPUs): {load['start']:.1f} at the start, "
                     f"{load['end']:.1f} at the end" + (f"; {load['note']}" if load.get("note") else "") + ".")
    lines += [""] + targets_table(report)
    for res in report["workloads"]:
        wl = res["workload"]
        lines += [f"## {wl}: {res['description']}", "",
                  "| variant | median step (s) | min-max (s) | mechanism share | host syncs / step (in mechanism) |",
                  "|---|---:|---:|---:|---:|"]
        for name, v in res["variants"].items():
            share = None if v["mechanism_share"] is None else 100 * v["mechanism_share"]
            syncs = "-" if v["host_syncs_per_step"] is None else \
                f"{v['host_syncs_per_step']} ({_fmt(v['mechanism_host_syncs_per_step'], 'd')})"
            lines.append(f"| {name} | {v['median_s']:.3f} | {v['min_s']:.3f}-{v['max_s']:.3f} | "
                         f"{_fmt(share, '.1f')}{'' if share is None else ' %'} | {syncs} |")
        lines += ["", "| ratio | measured | target |", "|---|---:|---:|"]
        for name, r in res["ratios"].items():
            ok = "" if r["target"] is None else (" (met)" if r["paired_median"] <= r["target"] else " (missed)")
            lines.append(f"| {name} | {r['paired_median']:.3f} | {_fmt(r['target'], '.2f')}{ok} |")
        mem = report.get("memory", {}).get(wl)
        if mem:
            lines += ["", "| variant | peak RSS during steps (MB) |", "|---|---:|"]
            lines += [f"| {k} | {v['peak_rss_mb']:.0f} |" for k, v in mem.items() if "peak_rss_mb" in v]
            lines.append("")
            lines += [f"Peak memory {name}: {mem[name]['ratio']:.3f} (target <= {mem[name]['target']:.2f})."
                      for name, _, _, _ in MEMORY_RATIOS if name in mem]
        lines.append("")
    tbs = report.get("train_vs_bench")
    if tbs:
        lines += ["## prismdp train against the bench's step", "",
                  "Per step, `prismdp train`'s wall time (its loop: the step, metrics, progress bar, epsilon at the "
                  "report steps, checkpoints; `elapsed_s` in metrics.jsonl) over the bench's PRISM step on the same "
                  "job and Poisson batch; runs alternate train, bench; medians of the per-step ratios.", "",
                  "| job | train s / step | bench s / step | train / bench | target |", "|---|---:|---:|---:|---:|"]
        for tb in tbs:
            ok = "met" if tb["paired_median"] <= tb["target"] else "missed"
            lines.append(f"| {tb['job']}: {tb['description']} | {statistics.median(tb['train_step_s']):.3f} | "
                         f"{statistics.median(tb['bench_step_s']):.3f} | {tb['paired_median']:.3f} | "
                         f"<= {tb['target']:.2f} ({ok}) |")
        lines.append("")
    micro = report.get("micro")
    if micro:
        lines += ["## Mechanism micro-benchmark (one module, b = 64, r = 16)", "",
                  "| m = n | PRISM step (ms) | of which accumulate / step (ms) | dense reference (ms) | dense / PRISM "
                  "| host syncs |", "|---:|---:|---:|---:|---:|---:|"]
        for row in micro["rows"]:
            dense = row.get("dense_median_s")
            lines.append(f"| {row['m']} | {1e3 * row['prism_median_s']:.2f} | "
                         f"{1e3 * row['accumulate_median_s']:.2f} / {1e3 * row['step_median_s']:.2f} | "
                         f"{'skipped' if dense is None else f'{1e3 * dense:.1f}'} | "
                         f"{'-' if dense is None else format(row['dense_over_prism'], '.0f') + 'x'} | "
                         f"{row['host_syncs_per_step']} |")
        if micro.get("prism_8192_over_1024") is not None:
            lines.append(f"\nPRISM math at m = n = 8192 / at 1024: {micro['prism_8192_over_1024']:.2f} (target <= 10).")
        lines.append("")
    ext = report.get("extrapolation")
    if ext:
        lines += extrap.markdown(ext)
        check = extrap.predicted_vs_measured(ext)
        if check:
            lines += [f"Model check (mechanism seconds per step on this CPU): {check}.", ""]
    notes = report.get("notes")
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", type=_csv, default=None,
                   help=f"of W0, {', '.join(WORKLOADS)} (default W0,W1,W2; --quick: W1,W2)")
    p.add_argument("--variants", type=_csv, default=list(VARIANTS),
                   help=f"of {', '.join(available_variants())} (default: {', '.join(VARIANTS)}; the ablation "
                        f"{', '.join(ABLATIONS)} is opt-in); W0 runs those of {', '.join(train_job.METHODS)}")
    p.add_argument("--steps", type=int, default=10, help="measured rounds (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up rounds (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="step and mechanism times: wall (default) or this process's CPU time (cpu: with --threads 1, "
                        "robust to other processes sharing the cores; train / bench stays wall time)")
    p.add_argument("--interleave", choices=("micro", "step"), default="micro",
                   help="variants alternate micro-batch by micro-batch (default: every variant's step measured under "
                        "the same load to within one micro-batch) or step by step")
    p.add_argument("--quick", action="store_true", help="1 warm-up + 2 rounds, no memory runs, no train / bench, "
                                                        "micro up to 1024")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory processes")
    p.add_argument("--train-jobs", type=_csv, default=None,
                   help=f"prismdp train against the bench's step on these jobs (of {', '.join(TRAIN_JOBS)}; default: "
                        "those among --workloads whose data is here; empty: skip)")
    p.add_argument("--train-steps", type=int, default=12, help="measured steps per train / bench run, after 2 warm-up "
                                                             "steps (default 12: W0's window holds one of its 8 "
                                                             "epsilon report steps, as often as its 100-step run)")
    p.add_argument("--micro-sizes", type=lambda s: [int(x) for x in _csv(s)], default=None,
                   help="m = n sizes of the micro-benchmark (default 256,...,8192; empty: skip)")
    p.add_argument("--note", action="append", default=[], help="a note for the results (repeatable), e.g. how the "
                                                               "machine was shared")
    p.add_argument("--output", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    workloads = args.workloads or (["W1", "W2"] if args.quick else ["W0", "W1", "W2"])
    unknown = [w for w in workloads if w not in WORKLOADS and w != "W0"] + \
        [v for v in args.variants if v not in available_variants()]
    unknown += [j for j in (args.train_jobs or []) if j not in TRAIN_JOBS]
    if unknown:
        p.error(f"unknown workload/variant/job {unknown}; workloads W0 and {list(WORKLOADS)}, "
                f"variants {list(available_variants())}, train jobs {list(TRAIN_JOBS)}")
    if args.memory_child:
        print(json.dumps(_memory_child(*args.memory_child, steps=max(1, min(args.steps, 2)))))
        return 0
    if args.quick:
        args.steps, args.warmup, args.no_memory = 2, 1, True
    jobs = args.train_jobs if args.train_jobs is not None else (
        [] if args.quick else [j for j in TRAIN_JOBS if j in workloads])
    sizes = args.micro_sizes if args.micro_sizes is not None else (
        [256, 512, 1024] if args.quick else [256, 512, 1024, 2048, 4096, 8192])
    load0 = os.getloadavg()[0]
    report = {"quick": args.quick, "steps": args.steps, "warmup": args.warmup, "clock": args.clock,
              "interleave": args.interleave,
              "environment": environment(args.threads), "workloads": [], "memory": {}, "notes": args.note}
    for wl in workloads:
        if wl == "W0":
            methods = [m for m in train_job.METHODS if m in args.variants]
            got = train_job.time_job("W0", methods, args.steps, args.warmup, clock=CLOCKS[args.clock],
                                     interleave=args.interleave)
            report["workloads"].append(summarize("W0", got["description"], got["times"]))
            continue
        report["workloads"].append(time_steps(wl, args.variants, args.steps, args.warmup, clock=CLOCKS[args.clock],
                                              interleave=args.interleave))
        if not args.no_memory:
            report["memory"][wl] = measure_memory(wl, args.variants, args.threads, args.steps)
    report["train_vs_bench"] = [train_job.train_vs_bench(j, args.train_steps, 2) for j in jobs
                                if train_job.available(j)]
    if sizes:
        report["micro"] = run_micro(sizes, steps=2 if args.quick else 5, dense_max=1024 if args.quick else 4096)
        if len(sizes) >= 2:  # the fits need two sizes
            report["extrapolation"] = extrap.extrapolate(report["micro"], report["workloads"])
    report["environment"]["load"] = {"start": load0, "end": os.getloadavg()[0]}
    out = Path(args.output)
    stem = "bench-quick" if args.quick else "bench"
    write(out / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    write(out / f"{stem}.md", md)
    print(md)
    print(f"[bench] wrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
