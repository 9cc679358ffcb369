"""Issue 12's benchmarks: prismdp the way users scale it, measured on this CPU
(``python -m bench.studies.scaling``).

1. Precision and checkpointing (W2, SmolLM2-135M, PRISM): the frozen base model in float32 or bfloat16 (LoRA factors,
   per-example gradients and PRISM's math float32, as ``prismdp train --dtype bfloat16``), with or without transformers'
   gradient checkpointing (``--gradient-checkpointing``, non-re-entrant).  Step time: the four variants interleaved in
   one process; peak memory: each alone in a fresh process (peak RSS of its training steps, as ``python -m bench``).
2. Processes (W1, MiniLM, PRISM): two gloo processes with one thread each against one process with two threads, the
   same logical batch (each rank runs every second micro-batch; the clipped sums are all-reduced once per step and
   every rank runs PRISM's step on the same release).  Runs alternate one process, two processes, ...; step times
   are rank 0's after a barrier.

Writes ``OUT/scaling.json`` and ``OUT/scaling.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

import torch

PRECISION_VARIANTS = ("prism", "prism-bf16", "prism-ckpt", "prism-bf16-ckpt")


def precision(workload: str, steps: int, warmup: int, threads: int, memory: bool, log=print) -> dict:
    from ..__main__ import measure_memory, time_steps

    res = time_steps(workload, list(PRECISION_VARIANTS), steps, warmup, log=log)
    out = {"timing": res}
    if memory:
        out["memory"] = measure_memory(workload, list(PRECISION_VARIANTS), threads, steps, log=log)
    return out


def _timed(step, steps: int, warmup: int, before=lambda: None) -> List[float]:
    """Wall seconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones; ``before`` runs untimed before each
    (a barrier in a multi-process run)."""
    times = []
    for i in range(warmup + steps):
        before()
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return times


def _rank_worker(rank: int, world: int, init_file: str, workload: str, steps: int, warmup: int, out: str) -> None:
    """One process of a gloo run: 1 thread, its shard of the micro-batches, step times to ``out`` (rank 0)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        from ..workloads import WORKLOADS, build_variant

        w = WORKLOADS[workload]
        v = build_variant("prism", w, w.load(), shard=(rank, world))
        times = _timed(v.step, steps, warmup, before=dist.barrier)
        dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps({"times_s": times, "mechanism_s": v.mechanism.seconds}))
    finally:
        dist.destroy_process_group()


def _one_process(workload: str, steps: int, warmup: int, threads: int) -> List[float]:
    from ..workloads import WORKLOADS, build_variant

    torch.set_num_threads(threads)
    w = WORKLOADS[workload]
    v = build_variant("prism", w, w.load())
    return _timed(v.step, steps, warmup)


def _two_processes(workload: str, steps: int, warmup: int) -> List[float]:
    import torch.multiprocessing as mp

    tmp = Path(tempfile.mkdtemp(prefix="prismdp-scaling-"))
    ctx = mp.get_context("spawn")
    out = tmp / "rank0.json"
    procs = [ctx.Process(target=_rank_worker, args=(r, 2, str(tmp / "init"), workload, steps, warmup, str(out)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs) or not out.is_file():
        raise RuntimeError(f"a gloo rank failed (exit codes {[p.exitcode for p in procs]})")
    return json.loads(out.read_text())["times_s"]


def processes(workload: str, steps: int, warmup: int, pairs: int, log=print) -> dict:
    one: List[float] = []
    two: List[float] = []
    for p in range(pairs):
        a = _one_process(workload, steps, warmup, threads=2)
        b = _two_processes(workload, steps, warmup)
        one += a
        two += b
        log(f"[scaling] {workload} pair {p + 1}/{pairs}: 1 x 2 threads {statistics.median(a):.3f} s, "
            f"2 gloo x 1 thread {statistics.median(b):.3f} s per step")
    return {"workload": workload, "one_process_2_threads_s": one, "two_processes_1_thread_s": two,
            "ratio_of_medians": statistics.median(two) / statistics.median(one),
            "paired_median": statistics.median(b / a for a, b in zip(one, two))}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# prismdp scaling benchmark (issue 12)", "",
             f"{env['date']}, commit {env['commit']}, torch {env['torch']}, {env['cpus']} CPU(s), {env['machine']}. "
             f"Machine load (1-minute average) {env['load']['start']:.1f} at the start, {env['load']['end']:.1f} at "
             "the end.", ""]
    prec = report.get("precision")
    if prec:
        res, mem = prec["timing"], prec.get("memory", {})
        base = res["variants"]["prism"]["median_s"]
        lines += [f"## {res['workload']} (PRISM): bfloat16 base and gradient checkpointing", "",
                  f"{report['threads']} thread(s); {res['description']}. Step time interleaved in one process "
                  "(median, and paired ratio to float32 without checkpointing); peak RSS of the training steps, each "
                  "variant in its own process.", "",
                  "| variant | median step (s) | / float32 (paired) | peak RSS (MB) | / float32 |",
                  "|---|---:|---:|---:|---:|"]
        f32 = res["variants"]["prism"]["times_s"]
        for name, v in res["variants"].items():
            paired = statistics.median(a / b for a, b in zip(v["times_s"], f32))
            m = mem.get(name, {}).get("peak_rss_mb")
            m0 = mem.get("prism", {}).get("peak_rss_mb")
            label = {"prism": "float32", "prism-bf16": "bfloat16", "prism-ckpt": "float32 + checkpointing",
                     "prism-bf16-ckpt": "bfloat16 + checkpointing"}[name]
            lines.append(f"| {label} | {v['median_s']:.3f} | {paired:.3f} | {'-' if m is None else f'{m:.0f}'} | "
                         f"{'-' if m is None or not m0 else f'{m / m0:.3f}'} |")
        lines += ["", f"(float32 without checkpointing: {base:.3f} s per step.)", ""]
    proc = report.get("processes")
    if proc:
        lines += [f"## {proc['workload']} (PRISM): two gloo processes x 1 thread against one process x 2 threads", "",
                  "| run | median step (s) |", "|---|---:|",
                  f"| 1 process x 2 threads | {statistics.median(proc['one_process_2_threads_s']):.3f} |",
                  f"| 2 gloo processes x 1 thread | {statistics.median(proc['two_processes_1_thread_s']):.3f} |", "",
                  f"Two processes / one process: {proc['ratio_of_medians']:.3f} (ratio of medians; per-step paired "
                  f"median {proc['paired_median']:.3f}).", ""]
    for n in report.get("notes", []):
        lines.append(f"- {n}")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    from ..common import environment, write

    p = argparse.ArgumentParser(prog="python -m bench.studies.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads of the precision runs (default 2)")
    p.add_argument("--pairs", type=int, default=2, help="alternations of the process comparison (default 2)")
    p.add_argument("--parts", default="precision,processes")
    p.add_argument("--precision-workload", default="W2")
    p.add_argument("--process-workload", default="W1")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--output", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    load0 = os.getloadavg()[0]
    report: Dict = {"threads": args.threads, "steps": args.steps, "warmup": args.warmup,
                    "environment": environment(args.threads), "notes": args.note}
    if "precision" in parts:
        torch.set_num_threads(args.threads)
        report["precision"] = precision(args.precision_workload, args.steps, args.warmup, args.threads,
                                        not args.no_memory)
    if "processes" in parts:
        report["processes"] = processes(args.process_workload, args.steps, args.warmup, args.pairs)
    report["environment"]["load"] = {"start": load0, "end": os.getloadavg()[0]}
    out = Path(args.output)
    write(out / "scaling.json", json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    write(out / "scaling.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
