"""W0 -- what ``prismdp train`` runs with no flags -- and what the trainer adds to a step.

Jobs (:data:`JOBS`): ``W0`` is ``prismdp train``'s embedded default job (the packaged MiniLM on the built-in
synthetic task, LoRA r 4 on query/value, dropout 0.05, expected batch 128 as micro-batches of 8, epsilon 3 over 100
steps); ``W1`` and ``W2`` are trainer jobs with the model, LoRA targets, rank, batch and micro-batch of the bench's
workloads W1 and W2, on the built-in synthetic task (W1) and Math-10K (W2, when /work/shared/data is there).

* :func:`time_job` -- each method's run built by the trainer's own builder (:func:`prismdp.train.build.build_run`),
  stepped in one process on the same Poisson batches, interleaved micro-batch by micro-batch (as the workloads are):
  ``backward_batch`` then ``private.queue_step(totals).read()``, what ``metrics.jsonl``'s ``step_time_s`` times.
  W0 in the bench is this.
* :func:`train_vs_bench` -- ``prismdp train`` itself (:func:`prismdp.train.loop.train` in this process, progress bar
  on, stopped after ``steps`` steps of the job's full length, so epsilon is shown as often as in the real run)
  against the bench's step on the same job and batches: per step, the trainer's wall time (``metrics.jsonl``
  ``elapsed_s`` differences: everything its loop does -- the step, metrics, progress bar, epsilon at the report steps,
  checkpoints) over the bench's step time; runs alternate train, bench, train, bench.
"""

from __future__ import annotations

import contextlib
import functools
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .common import interleaved_round

MATH10K = Path("/work/shared/data/math/math_10k.json")

JOBS: Dict[str, dict] = {
    "W0": {},  # the defaults: what `prismdp train` runs
    "W1": {"rank": 16, "alpha": 16.0, "target_modules": ["query", "key", "value"], "batch_size": 32.0,
           "micro_batch_size": 4, "steps": 500},
    "W2": {"task": "instruct", "data": str(MATH10K), "rank": 16, "alpha": 16.0,
           "target_modules": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"], "batch_size": 8.0,
           "micro_batch_size": 4, "max_length": 128, "steps": 300},
}
JOB_DESCRIPTIONS = {
    "W0": "prismdp train's default job: packaged MiniLM, synthetic task, LoRA r 4 on query/value, dropout 0.05, "
          "expected batch 128 as micro-batches of 8, 100 steps at epsilon 3",
    "W1": "prismdp train with W1's model and LoRA (MiniLM, r 16 on query/key/value), expected batch 32 as "
          "micro-batches of 4, synthetic task",
    "W2": "prismdp train with W2's model and LoRA (SmolLM2-135M, r 16 on q/k/v/up/down), expected batch 8 as "
          "micro-batches of 4, Math-10K, length 128",
}
# the job's methods and how each is configured (lora-adamw: the trainer's non-private run of the same optimizer)
METHODS = {"prism": {"method": "prism"}, "dp-adamw": {"method": "dp-adamw"},
           "lora-adamw": {"method": "dp-adamw", "dp": False}}


def available(job: str) -> bool:
    return job != "W2" or MATH10K.is_file()


def _config(job: str, method: str, output: str):
    from prismdp.train.config import TrainConfig

    return TrainConfig(output=output, synthetic_test=64, **METHODS[method], **JOBS[job])


def _build(job: str, method: str):
    from prismdp.train.build import build_run

    run = build_run(_config(job, method, tempfile.mkdtemp(prefix="prismdp-bench-")), log=lambda *a: None)
    run.model.train()
    return run


def _backward(run, indices, group_by_length: bool, units):
    """``backward_batch`` of ``run`` on ``indices`` (its forward and backward, micro-batch by micro-batch), ready to
    call."""
    from prismdp.train.step import backward_batch

    return functools.partial(backward_batch, run.private, run.model, run.data.train, run.data.loss, indices,
                             run.cfg.micro_batch_size, run.tokenizer.pad_token_id, run.device, group_by_length,
                             units=units)


def _stepper(run, clock=time.perf_counter):
    batches = iter(run.private.batches())

    def step() -> float:
        backward = _backward(run, next(batches), run.cfg.group_by_length, run.data.units)
        t0 = clock()
        run.private.queue_step(backward()).read()  # as train/loop.py: one read, after the step is queued
        return clock() - t0

    return step


def _parts(run, batch) -> list:
    """One logical step of ``run`` on ``batch`` as parts: each micro-batch's forward and backward
    (``backward_batch`` on that micro-batch's examples), then the update."""
    from prismdp.train.step import micro_batch_plan

    cfg = run.cfg
    plan = micro_batch_plan(batch, run.data.train, cfg.micro_batch_size, cfg.group_by_length, run.data.units)
    return [_backward(run, micro, False, None) for micro, _ in plan] + [run.private.step]


def time_job(job: str, methods: List[str], steps: int, warmup: int, log=print, clock=time.perf_counter,
             interleave: str = "micro") -> dict:
    """The job's methods stepped interleaved (:func:`bench.common.interleaved_round`) on the same Poisson batches
    (drawn by the first method's sampler); the same result layout as the workloads'."""
    t0 = time.perf_counter()
    runs = {m: _build(job, m) for m in methods}
    if any(r.data.units is not None for r in runs.values()):
        raise ValueError("bench's train jobs are example-level; user-level units are not interleaved")
    batches = iter(next(iter(runs.values())).private.batches())
    log(f"[bench] {job}: built {len(methods)} trainer runs in {time.perf_counter() - t0:.1f} s")
    times: Dict[str, List[float]] = {m: [] for m in methods}
    for rnd in range(warmup + steps):
        batch = next(batches)
        took = interleaved_round({m: _parts(r, batch) for m, r in runs.items()}, clock, interleave)
        if rnd >= warmup:
            for m in methods:
                times[m].append(took[m])
        log(f"[bench] {job} round {rnd + 1}/{warmup + steps}" + (" (warm-up)" if rnd < warmup else "") + ": "
            + ", ".join(f"{m} {took[m]:.3f}s" for m in methods))
    return {"workload": job, "description": JOB_DESCRIPTIONS[job], "times": times}


def _trainer_step_walls(job: str, steps: int) -> List[float]:
    """``prismdp train`` on the job, stopped after ``steps`` steps: wall seconds of each loop iteration."""
    from prismdp.train.loop import train
    from prismdp.train.run_folder import read_metrics

    out = Path(tempfile.mkdtemp(prefix="prismdp-bench-")) / "run"
    with contextlib.redirect_stderr(io.StringIO()):  # the progress bar runs (its cost counts), its text is dropped
        train(_config(job, "prism", str(out)), stop_after=steps, progress=True, log=lambda *a: None)
    elapsed = [r["elapsed_s"] for r in read_metrics(out / "metrics.jsonl")]
    return [b - a for a, b in zip([0.0] + elapsed[:-1], elapsed)]


def train_vs_bench(job: str, steps: int, warmup: int, pairs: int = 2, log=print) -> dict:
    """Per step: ``prismdp train``'s wall time over the bench's step time on the same batch (PRISM), ``pairs`` runs of
    each, alternating; medians of the per-step ratios after ``warmup`` steps."""
    ratios, train_s, bench_s = [], [], []
    for p in range(pairs):
        walls = _trainer_step_walls(job, warmup + steps)
        step = _stepper(_build(job, "prism"))
        ts = [step() for _ in range(warmup + steps)]
        ratios += [w / t for w, t in zip(walls[warmup:], ts[warmup:])]
        train_s += walls[warmup:]
        bench_s += ts[warmup:]
        log(f"[bench] {job} train vs bench, pair {p + 1}/{pairs}: train {statistics.median(walls[warmup:]):.3f} s, "
            f"bench {statistics.median(ts[warmup:]):.3f} s per step")
    return {"job": job, "description": JOB_DESCRIPTIONS[job], "steps": steps, "warmup": warmup, "pairs": pairs,
            "train_step_s": train_s, "bench_step_s": bench_s, "paired_median": statistics.median(ratios),
            "ratio_of_medians": statistics.median(train_s) / statistics.median(bench_s), "target": 1.02}

