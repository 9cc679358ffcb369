"""prismdp's GPU benchmark: ``python -m bench.gpu`` (from the repository root; about 5 minutes on one H100 or H200).

Random-init Llama-3.2-1B and Gemma-3-4B (text) built on the device in bf16 (:mod:`bench.gpu_models`), float32 LoRA
r 16 on q/k/v/up/down, length 256, random tokens; the variants of :mod:`bench.gpu_variants` (the PEFT + AdamW
reference with the model's own loss, prismdp ``--no-dp``, dp-adamw, prism with LoRA dropout 0 and 0.05, Opacus'
DP-AdamW) over a micro-batch sweep (32, 16, 8, 4 where they divide the logical batch, the largest first; an
out-of-memory error is recorded and the variant rebuilt for the next size).  Per shape and micro-batch size: one
warm-up round (host syncs counted in it), then measured rounds, each one logical step of every variant in a
rotated order, CUDA-synchronised; medians over rounds, paired per-round ratios, tokens/s, model-FLOP utilisation
against the chip's bf16 peak, the step's peak memory above the resident state (:mod:`bench.gpu_report`).
``--time-budget`` seconds are shared out between shapes and cells by their expected cost; a cell runs at least
``--min-rounds`` and at most ``--rounds`` measured rounds, and nothing starts that would overrun the budget; the
budget's end is also a hard deadline (:func:`hard_deadline`): work it cannot foresee, building a full-size model on
the CPU, is cut there and the files written.  A ``--device`` this torch cannot use is refused in one line (exit 2).
Results are written after every cell (a run cut short leaves its partial results) to ``OUT/gpu-<device>.json``
and ``.md``.

Without CUDA (or with ``--tiny``) it runs tiny models of the same structure on the CPU and writes to a temporary
folder: a check of the script, not a measurement.

    python -m bench.gpu                                  # both shapes, every variant, 240 s budget
    python -m bench.gpu --shapes llama-3.2-1b --variants reference,prism --micro 8,16
    python -m bench.gpu --tiny                           # tiny shapes (the test suite runs this on the CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import signal
import sys
import threading
import tempfile
import time
import traceback
import warnings
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, List

import torch

from . import code_commit
from .gpu_models import GPU_SHAPES, SHAPES, TINY_SHAPES, Shape, bf16_peak_tflops, build_base, flops_per_token, sanitize
from .gpu_report import GB, RATIOS, markdown, summarize_shape  # noqa: F401 (RATIOS: the report's ratios)
from .gpu_variants import VARIANTS, batch, build_variant
from .micro import HostSyncCounter

# ------------------------------------------------------------------ one step, timed or counted

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(step: Callable[[], None], device: torch.device, now: Callable[[], float] = time.perf_counter
               ) -> tuple[float, float | None]:
    """Seconds of one step (CUDA-synchronised) and its peak allocated memory above the memory allocated before it
    (bytes; None off CUDA)."""
    _sync(device)
    resident = None
    if device.type == "cuda":
        resident = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = now()
    step()
    _sync(device)
    dt = now() - t0
    peak = None if resident is None else torch.cuda.max_memory_allocated(device) - resident
    return dt, peak


def counted_step(step: Callable[[], None], device: torch.device, now: Callable[[], float] = time.perf_counter
                 ) -> tuple[float, int, int | None]:
    """One step under the host-synchronisation counters: seconds, host synchronisations as the CPU sees them
    (:class:`bench.micro.HostSyncCounter`: tensor reads to the host plus factorisations that read their status on
    CUDA) and, on CUDA, synchronising CUDA calls (``torch.cuda``'s sync debug mode, one warning each)."""
    cuda = device.type == "cuda"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with HostSyncCounter() as counter:
                dt, _ = timed_step(step, device, now)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    cuda_syncs = sum("synchroniz" in str(w.message) for w in caught) if cuda else None
    return dt, counter.count + counter.status_reads, cuda_syncs


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ the schedule

class Clock:
    """The time budget: a hard deadline for the run, shares of what is left for shapes and cells."""

    def __init__(self, budget_s: float, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self.deadline = now() + budget_s

    def left(self) -> float:
        return self.deadline - self.now()

    def share(self, weight: float, total_weight: float) -> float:
        """An absolute deadline for a part of weight ``weight`` out of ``total_weight`` still to run."""
        return self.now() + max(0.0, self.left()) * weight / total_weight


class BudgetSpent(BaseException):
    """The time budget ran out mid-work (building a model, a first step): not an ``Exception``, so that the
    per-variant handlers let it through to :func:`main`, which records it and writes the files."""


@contextlib.contextmanager
def hard_deadline(clock: Clock):
    """Raise :class:`BudgetSpent` in the main thread when ``clock``'s budget ends (``SIGALRM``; a no-op where there
    is none, or off the main thread).  The budget then holds while models are built and first steps run, which the
    schedule cannot predict: a full-size model built on the CPU is cut at the deadline, not minutes after it."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(signum, frame):
        raise BudgetSpent("time budget of the run spent")

    left = clock.left()
    if left <= 0:
        raise BudgetSpent("time budget of the run spent")
    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, left)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def resolve_device(name: str | None) -> torch.device:
    """The device to benchmark (default: CUDA where this torch has it, else the CPU); a device this torch cannot
    use is a ``ValueError`` with one line naming the problem and the fix."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a device ({str(e).splitlines()[0]}); use cuda, cuda:N or cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; run on a GPU "
                             "host with a CUDA build of torch, or use --device cpu (a check, not a measurement)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here; use "
                             f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: the benchmark runs on cuda or cpu")
    return device


def refuse(prog: str, problem: Exception) -> int:
    """One line on stderr, exit status 2 (as argparse's own errors)."""
    print(f"{prog}: error: {problem}", file=sys.stderr)
    return 2


def _failure(e: BaseException, micro: int | None) -> dict:
    """A variant's failed step or build: out of memory (recorded, expected at large micro-batches) or an error (a
    bug: recorded so that the other variants still run, and the run exits non-zero)."""
    oom = isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))
    return {"status": "out of memory" if oom else "error", "micro": micro,
            "error": "".join(traceback.format_exception_only(type(e), e)).strip()[-1500:]}


def run_cell(variants: Dict[str, object], micro: int, device: torch.device, clock: Clock, cell_deadline: float,
             shape_deadline: float, rounds: int, min_rounds: int, log=print) -> dict:
    """One micro-batch size: a warm-up round (host syncs counted in it), then measured rounds in a rotated order:
    at least ``min_rounds`` (one past the shape's share) and at most ``rounds``, none past the budget's end.  A
    variant that fails (out of memory or an error) is recorded and released."""
    out: Dict[str, dict] = {}
    live = [n for n, v in variants.items() if v.model is not None]

    def attempt(name: str, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 -- recorded; the variant leaves this cell
            out[name] = _failure(e, micro)
            log(f"[bench.gpu] {name} at micro-batch {micro}: {out[name]['status']}: {out[name]['error'][-300:]}")
        variants[name].release()
        live.remove(name)
        _free(device)
        return None

    t0 = clock.now()
    for name in list(live):
        got = attempt(name, lambda: counted_step(lambda: variants[name].step(micro), device, clock.now))
        if got is not None:
            variants[name].check_shared()
            out[name] = {"status": "ok", "warmup_s": got[0], "host_syncs_per_step": got[1],
                         "cuda_syncs_per_step": got[2], "times_s": [], "peak_bytes": []}
    last = clock.now() - t0
    r = 0
    while r < rounds and live:
        end = clock.now() + last  # the next round's expected end
        if end > clock.deadline or (r >= 1 and end > shape_deadline) or (r >= min_rounds and end > cell_deadline):
            break
        t0 = clock.now()
        k = r % len(live)
        for name in live[k:] + live[:k]:
            got = attempt(name, lambda: timed_step(lambda: variants[name].step(micro), device, clock.now))
            if got is not None:
                out[name]["times_s"].append(got[0])
                if got[1] is not None:
                    out[name]["peak_bytes"].append(got[1])
        last = clock.now() - t0
        r += 1
        log(f"[bench.gpu] micro-batch {micro} round {r}: "
            + ", ".join(f"{n} {out[n]['times_s'][-1]:.3f}s" for n in live))
    for name in live:
        variants[name].check_shared()
    return {"micro": micro, "rounds": r, "round_s": last, "variants": out}


def first_steps(variants: Dict[str, object], micro: int, device: torch.device) -> Dict[str, dict]:
    """Each variant's first step (untimed for the results: optimizer state, hooks, kernels), its seconds."""
    got = {}
    for name, v in variants.items():
        try:
            got[name] = {"status": "ok", "first_step_s": timed_step(lambda: v.step(micro), device)[0]}
            v.check_shared()
        except Exception as e:  # noqa: BLE001 -- recorded, see run_cell
            got[name] = _failure(e, micro)
            v.release()
            _free(device)
    return got


def run_shape(shape: Shape, names: List[str], micro_sizes: List[int], device: torch.device, clock: Clock,
              shape_deadline: float, rounds: int, min_rounds: int, on_cell=lambda res: None, log=print,
              peak: float | None = None) -> dict:
    """Build every variant of ``shape`` (shared frozen weights), take one first step each at the first micro-batch
    size, then run the cells in the order of ``micro_sizes``; skip a cell whose warm-up and first round would end
    past the shape's share.  A variant that ran out of memory is rebuilt for the next cell; one that failed
    otherwise stays out."""
    res = {"shape": shape.name, "description": shape.description, "config": shape.config, "batch": shape.batch,
           "seq_len": shape.seq_len, "rank": shape.rank, "targets": list(shape.targets),
           "tokens_per_step": shape.tokens_per_step, "flops_per_token": flops_per_token(shape), "cells": [],
           "variants": {}, "status": "running", "peak_tflops": peak}
    t0 = clock.now()
    base = build_base(shape, device)
    ids = batch(shape, base.get_input_embeddings().num_embeddings, device)
    res["attention"] = base.config._attn_implementation
    res["frozen_weights_gb"] = sum(p.numel() * p.element_size() for p in base.parameters()) / GB
    variants, broken = {}, {}  # broken: variants that failed other than by running out of memory

    def build(n: str) -> None:
        try:
            variants[n] = build_variant(n, shape, base, ids)
            log(f"[bench.gpu] {shape.name}: built {n} ({clock.now() - t0:.1f} s)")
        except Exception as e:  # noqa: BLE001 -- recorded; the other variants still run
            broken[n] = res["variants"][n] = {**_failure(e, None), "when": "build"}
            log(f"[bench.gpu] {shape.name}: building {n} failed: {broken[n]['error'][-300:]}")
            _free(device)

    for n in names:
        build(n)
    _sync(device)
    res["build_s"] = clock.now() - t0
    if device.type == "cuda":
        res["resident_gb"] = torch.cuda.memory_allocated(device) / GB
    t0 = clock.now()
    first = first_steps(variants, micro_sizes[0], device)
    res["variants"].update(first)
    broken.update({n: v for n, v in first.items() if v["status"] == "error"})
    estimate = clock.now() - t0  # a round's expected time: the last one measured
    log(f"[bench.gpu] {shape.name}: first steps at micro-batch {micro_sizes[0]}: " + ", ".join(
        f"{n} {v['first_step_s']:.2f}s" if "first_step_s" in v else f"{n} {v['status']}" for n, v in first.items()))
    for i, micro in enumerate(micro_sizes):
        # room for its warm-up and one measured round (the first cell: within the budget; the others: the share)
        if clock.now() + 2 * estimate > min(clock.deadline, shape_deadline if i else clock.deadline):
            res["cells"].append({"micro": micro, "rounds": 0, "skipped": "time budget", "variants": {}})
            log(f"[bench.gpu] {shape.name}: micro-batch {micro} skipped (time budget)")
            continue
        for n in names:  # out of memory at a larger micro-batch: a fresh copy for this one
            if i and n not in broken and variants[n].model is None:
                del variants[n]
                _free(device)
                build(n)
        cell_deadline = clock.now() + max(0.0, shape_deadline - clock.now()) / (len(micro_sizes) - i)
        cell = run_cell({n: v for n, v in variants.items() if n not in broken and v.model is not None}, micro,
                        device, clock, cell_deadline, shape_deadline, rounds, min_rounds, log)
        estimate = cell["round_s"]
        for n in names:
            v = cell["variants"].get(n)
            if v is None and i == 0 and first.get(n, {}).get("status") == "out of memory":
                cell["variants"][n] = v = first[n]  # its first step at this size ran out of memory
            if v is None:
                why = broken.get(n, {})
                v = cell["variants"][n] = {"status": "skipped: " + (
                    f"{why['status']} ({why.get('when') or 'micro-batch ' + str(why.get('micro'))})" if why
                    else "not built")}
            if v["status"] == "error":
                broken[n] = v
        res["cells"].append(cell)
        summarize_shape(res)
        on_cell(res)
    res["status"] = "done"
    summarize_shape(res)
    del variants, base
    _free(device)
    return res


# ------------------------------------------------------------------ environment, files, command line

def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    commit = code_commit()
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit, "device": device.type,
           "device_name": name, "peak_tflops": bf16_peak_tflops(name) if cuda else None,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "versions": {k: _version(k) for k in ("torch", "transformers", "peft", "opacus", "prismdp")},
           "python": platform.python_version(), "machine": f"{platform.machine()} {platform.system()}",
           "cpus": os.cpu_count()}
    env["versions"]["torch"] = torch.__version__
    if cuda:
        props = torch.cuda.get_device_properties(device)
        env.update(device_memory_gb=props.total_memory / GB, capability=f"{props.major}.{props.minor}",
                   device_count=torch.cuda.device_count())
    return env


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(output: str, name: str, report: dict, md: str) -> Path:
    """``OUT/<name>-<device>.json`` and ``.md`` (each written atomically); prints the markdown; returns the stem."""
    stem = Path(output) / f"{name}-{sanitize(report['environment']['device_name'])}"
    _write(stem.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    _write(stem.with_suffix(".md"), md)
    print(md)
    return stem


def _csv(s: str) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--shapes", type=_csv, default=None,
                   help=f"of {', '.join(SHAPES)} (default {','.join(GPU_SHAPES)}; --tiny or no CUDA: "
                        f"{','.join(TINY_SHAPES)})")
    p.add_argument("--variants", type=_csv, default=list(VARIANTS), help=f"of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--micro", type=lambda s: [int(x) for x in _csv(s)], default=None,
                   help="micro-batch sizes (default per shape: 4,8,16,32 up to the logical batch)")
    p.add_argument("--time-budget", type=float, default=240.0,
                   help="seconds for building and measuring, shared out between shapes and cells (default 240: the "
                        "whole run, imports and start-up included, within 5 minutes)")
    p.add_argument("--rounds", type=int, default=5, help="most measured rounds per micro-batch size (default 5)")
    p.add_argument("--min-rounds", type=int, default=3,
                   help="measured rounds a cell runs even past its share of the budget, never past the budget "
                        "(default 3)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (default without CUDA)")
    p.add_argument("--device", default=None, help="default cuda if available, else cpu")
    p.add_argument("--note", action="append", default=[], help="a note for the results (repeatable), e.g. the "
                                                               "commit where the working tree has no git history")
    p.add_argument("--output", default=None, help="default bench/results on CUDA (full shapes), a temporary folder "
                                                  "otherwise (CPU results are no GPU measurement)")
    args = p.parse_args(argv)
    bad = [s for s in (args.shapes or []) if s not in SHAPES] + [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown shape/variant {bad}; shapes {list(SHAPES)}, variants {list(VARIANTS)}")
    if args.micro is not None and any(m < 1 for m in args.micro):
        p.error("micro-batch sizes must be positive")
    if args.rounds < 1 or not 0 <= args.min_rounds <= args.rounds:
        p.error("need --rounds >= 1 and 0 <= --min-rounds <= --rounds")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    clock = Clock(args.time_budget)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        return refuse("python -m bench.gpu", e)
    tiny = args.tiny or device.type != "cuda"
    shapes = [SHAPES[s] for s in (args.shapes or (TINY_SHAPES if tiny else GPU_SHAPES))]
    env = environment(device)
    stem = f"gpu-{sanitize(env['device_name'])}" + ("-tiny" if tiny else "")
    out = Path(args.output) if args.output else (
        Path(__file__).resolve().parent / "results" if device.type == "cuda" and not tiny
        else Path(tempfile.gettempdir()) / "prismdp-bench-gpu")
    report = {"command": ["python", "-m", "bench.gpu", *(sys.argv[1:] if argv is None else argv)],
              "environment": env, "tiny": tiny, "time_budget_s": args.time_budget, "rounds": args.rounds,
              "min_rounds": args.min_rounds, "variants": args.variants, "status": "running", "elapsed_s": 0.0,
              "notes": args.note, "shapes": []}
    t_start = clock.now()

    def save() -> None:
        report["elapsed_s"] = clock.now() - t_start
        _write(out / f"{stem}.json", json.dumps(report, indent=2) + "\n")
        _write(out / f"{stem}.md", markdown(report))

    sizes = {s.name: sorted({m for m in (args.micro or s.micro_sizes) if m <= s.batch and s.batch % m == 0},
                            reverse=True) for s in shapes}  # the largest first: the likeliest best, the cheapest
    weights = [len(sizes[s.name]) * s.tokens_per_step * flops_per_token(s)["total"] for s in shapes]
    failed = False
    for i, shape in enumerate(shapes):
        report["shapes"].append({"shape": shape.name, "description": shape.description, "status": "not started"})
        if clock.left() <= 0 or not sizes[shape.name]:
            report["shapes"][-1]["status"] = "skipped: " + ("time budget" if sizes[shape.name] else
                                                            "no micro-batch size divides the logical batch")
            continue
        deadline = clock.share(weights[i], sum(weights[i:]))

        def on_cell(res, i=i):
            report["shapes"][i] = res
            save()

        print(f"[bench.gpu] {shape.name} on {env['device_name']}: micro-batches {sizes[shape.name]}, "
              f"{deadline - clock.now():.0f} s of {clock.left():.0f} s left", flush=True)
        try:
            with hard_deadline(clock):
                res = run_shape(shape, args.variants, sizes[shape.name], device, clock, deadline, args.rounds,
                                args.min_rounds, on_cell=on_cell, log=lambda m: print(m, flush=True),
                                peak=env["peak_tflops"])
            report["shapes"][i] = res
        except BudgetSpent:  # mid-build or mid-step: what was measured is kept, the rest is skipped
            report["shapes"][i]["status"] = "cut: time budget"
            print(f"[bench.gpu] {shape.name}: time budget spent after {clock.now() - t_start:.0f} s; stopped",
                  flush=True)
            _free(device)
        except Exception:  # noqa: BLE001 -- recorded; the next shape still runs
            report["shapes"][i].update(status="error", error=traceback.format_exc()[-3000:])
            print(f"[bench.gpu] {shape.name} failed:\n{traceback.format_exc()}", flush=True)
            _free(device)
        failed |= report["shapes"][i].get("status") == "error" or any(
            v.get("status") == "error" for c in report["shapes"][i].get("cells", [])
            for v in c["variants"].values()) or any(
            v.get("status") == "error" for v in report["shapes"][i].get("variants", {}).values())
        save()
    skipped = any(c.get("skipped") for r in report["shapes"] for c in r.get("cells", [])) or any(
        r.get("status", "").startswith(("skipped", "cut")) for r in report["shapes"])
    report["status"] = "errors (see the variants)" if failed else ("partial: time budget" if skipped else "complete")
    save()
    print(markdown(report))
    print(f"[bench.gpu] wrote {out / (stem + '.json')} and {out / (stem + '.md')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
