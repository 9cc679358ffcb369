"""Run an experiment grid cell by cell with the trainer, skipping finished cells, then write the result tables.

Each cell trains into ``OUT/<cell id>/`` (the trainer's usual files).  A cell whose ``summary.json`` exists is
done and skipped -- unless its saved ``config.json`` disagrees with the grid's current configuration for that cell,
which is reported as a failure (delete the folder, or use another ``--output``) rather than silently mixing results
of different settings.  A cell with a ``checkpoint.pt`` but no summary was interrupted and is resumed; one with
neither (stopped before its first checkpoint) is restarted.  A failing cell is reported and the others still run.
Cells kept in an earlier results.csv (``results_from``, :mod:`prismdp.experiment.archive`) count as done.
``OUT/experiment.json`` records the grid; ``OUT/results.csv``, ``results.md`` and ``results.tex`` are rewritten
after every cell (see :mod:`prismdp.experiment.tables`).  With ``tune`` in the file the cells to train are decided
as results arrive (:mod:`prismdp.experiment.tuning`).

Several processes may work on one grid (e.g. two single-threaded ones on a 2-core machine): a process claims a cell
by creating ``<cell>/.claim`` (exclusively) before training it and removes it afterwards; cells claimed by a live
process are passed over, claims of dead processes are taken over.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..atomic import write_json
from .archive import Archive
from .grid import Cell, Experiment, Setting, cell_id
from .tables import Table, write_results
from .tuning import Plan, is_done

__all__ = ["run_experiment", "ExperimentRun", "config_mismatch", "claim", "release"]

_RESOLVED_DEFAULTS = ("lr", "target_modules")  # None in the grid, filled in by the trainer
_PLACE_KEYS = ("output", "device", "threads")  # where and how a run happened, not what it computed


@dataclass
class ExperimentRun:
    output: Path
    cells: List[Cell]  # the selected cells
    ran: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    failures: Dict[str, str] = field(default_factory=dict)
    table: Optional[Table] = None


def _plain(v):
    return json.loads(json.dumps(v))


def config_mismatch(cell: Cell) -> List[str]:
    """TrainConfig keys on which the finished run in the cell's folder differs from the cell's configuration.

    Where the run happened (``output``, ``device``) does not count, and a key the saved configuration lacks (a
    newer prismdp added it) matches its default, which is what the older version did."""
    path = Path(cell.config.output) / "config.json"
    if not path.is_file():
        return []
    saved = json.loads(path.read_text())
    defaults = {f.name: f.default for f in dataclasses.fields(cell.config) if f.default is not dataclasses.MISSING}
    diffs = []
    for k, v in cell.config.to_dict().items():
        if k in _PLACE_KEYS or (v is None and k in _RESOLVED_DEFAULTS):
            continue
        if k not in saved and k in defaults and _plain(v) == _plain(defaults[k]):
            continue
        if _plain(saved.get(k)) != _plain(v):
            diffs.append(k)
    return diffs


def claim(folder: Path) -> bool:
    """Claim a cell's folder for this process; False if a live process (on this host) holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".claim"
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                held = json.loads(path.read_text())
                alive = held.get("host") == socket.gethostname() and _alive(int(held["pid"]))
            except (OSError, ValueError, KeyError, TypeError):
                alive = False  # unreadable or half-written: treat as stale
            if alive and held.get("pid") != os.getpid():
                return False
            path.unlink(missing_ok=True)  # stale (or our own): take it over
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(mine)
        return True
    return False


def release(folder: Path) -> None:
    (folder / ".claim").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _train_cell(cell: Cell, run: "ExperimentRun", train_fn, progress: bool, log, tag: str, archive=None) -> None:
    """Skip a finished cell (or report a configuration mismatch), else train / resume it; record the outcome."""
    folder = Path(cell.config.output)
    kept = archive.get(cell) if archive and not (folder / "summary.json").is_file() else None
    if kept is not None:
        run.skipped.append(cell.id)
        log(f"{tag}: done in {kept.source}, skipped")
        return
    if (folder / "summary.json").is_file():
        diffs = config_mismatch(cell)
        if diffs:
            msg = (f"{folder} holds a finished run with a different configuration ({', '.join(diffs)}); delete "
                   "the folder to rerun it, or use another --output")
            run.failures[cell.id] = msg
            log(f"{tag}: {msg}")
        else:
            run.skipped.append(cell.id)
            log(f"{tag}: done, skipped")
        return
    resume = (folder / "checkpoint.pt").is_file()
    if not resume and (folder / "metrics.jsonl").exists():
        (folder / "metrics.jsonl").unlink()  # stopped before its first checkpoint: nothing to resume
    log(f"{tag}: {'resuming' if resume else 'training'} -> {folder}")
    t0 = time.perf_counter()
    try:
        train_fn(cell.config, resume=resume, progress=progress, log=log)
    except Exception as e:  # noqa: BLE001 - one failing cell must not stop the grid
        run.failures[cell.id] = f"{type(e).__name__}: {e}"
        log(f"{tag}: FAILED {type(e).__name__}: {e}")
        log("".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-3)).rstrip())
        return
    run.ran.append(cell.id)
    log(f"{tag}: finished in {time.perf_counter() - t0:.1f} s")


def run_experiment(exp: Experiment, *, output: Optional[str] = None, tasks: Optional[Sequence[str]] = None,
                   methods: Optional[Sequence[str]] = None, settings: Optional[Sequence[Setting]] = None,
                   seeds: Optional[Sequence[int]] = None, dry_run: bool = False, tables_only: bool = False,
                   progress: bool = True, log: Callable[[str], None] = print,
                   train_fn: Optional[Callable] = None, poll_s: float = 30.0,
                   results_from: Sequence[str] = ()) -> ExperimentRun:
    """Train the selected cells (all by default) that are not done yet; write the tables over the whole grid.

    ``results_from``: earlier results.csv files whose cells count as done (:mod:`prismdp.experiment.archive`)."""
    if train_fn is None:
        from ..train.loop import train as train_fn
    archive = Archive([Path(p) for p in results_from])
    if exp.tune is not None and exp.tune.honest:
        return _run_honest(exp, output=output, tasks=tasks, methods=methods, settings=settings, seeds=seeds,
                           dry_run=dry_run, tables_only=tables_only, progress=progress, log=log, train_fn=train_fn,
                           archive=archive)
    if exp.tune is not None:
        return _run_tuned(exp, output=output, tasks=tasks, methods=methods, settings=settings, seeds=seeds,
                          dry_run=dry_run, tables_only=tables_only, progress=progress, log=log, train_fn=train_fn,
                          poll_s=poll_s, archive=archive)
    out_dir = Path(output if output is not None else exp.output)
    all_cells = exp.cells(str(out_dir))
    chosen = {c.id for c in exp.cells(str(out_dir), tasks=tasks, methods=methods, settings=settings, seeds=seeds)}
    cells = [c for c in all_cells if c.id in chosen]
    run = ExperimentRun(out_dir, cells)
    _run_cells(exp, run, all_cells, dry_run=dry_run, tables_only=tables_only, log=log, archive=archive,
               verb="trained", work=lambda cell, tag: _train_cell(cell, run, train_fn, progress, log, tag, archive))
    if dry_run:
        return run
    log(f"[experiment] {len(run.ran)} trained, {len(run.skipped)} skipped, {len(run.failures)} failed; results in "
        f"{out_dir / 'results.csv'}, {out_dir / 'results.md'}, {out_dir / 'results.tex'}")
    return run


def _run_cells(exp: Experiment, run: "ExperimentRun", every: List[Cell], *, dry_run: bool, tables_only: bool, log,
               archive, verb: str, work: Callable[[Cell, str], None], **described) -> None:
    """The one loop of a grid without rate tuning (plain or honest): list the selected cells (``dry_run``), or write
    experiment.json (``every`` cell's configuration, plus ``described``), then give each selected cell that is done
    or that this process claims to ``work(cell, tag)`` and rewrite the tables after it; the tables over ``every``
    cell are left in ``run.table``."""
    if dry_run:
        for c in run.cells:
            log(f"[experiment] {'done' if is_done(c, archive) else 'todo'} {c.id}")
        return
    run.output.mkdir(parents=True, exist_ok=True)
    write_json(run.output / "experiment.json", {
        "name": exp.name, "source": str(exp.path) if exp.path else None, "overrides": exp.overrides, **described,
        "cells": {c.id: {**c.config.to_dict(), "task_id": c.task_id} for c in every}})
    todo = [] if tables_only else run.cells
    for i, cell in enumerate(todo, 1):
        tag = f"[experiment] ({i}/{len(todo)}) {cell.id}"
        folder = Path(cell.config.output)
        if not is_done(cell, archive) and not claim(folder):
            log(f"{tag}: being {verb} by another process, passed over")
            continue
        try:
            work(cell, tag)
        finally:
            release(folder)
        write_results(exp, every, run.output, run.failures, archive=archive)
    _, run.table = write_results(exp, every, run.output, run.failures, archive=archive)


def _write_tuned_tables(exp: Experiment, out_dir: Path, failures, archive):
    """The tables over the whole grid, whatever subset (--tasks/--methods/--privacy) this process trains: every
    process writes the same complete results, as the untuned path does."""
    plan = Plan(exp, out_dir, failed=list(failures), archive=archive)
    return write_results(exp, plan.reported_cells(), out_dir, failures, plan=plan, archive=archive)[1]


def _run_tuned(exp: Experiment, *, output, tasks, methods, settings, seeds, dry_run, tables_only, progress, log,
               train_fn, poll_s, archive) -> ExperimentRun:
    """A grid with learning-rate tuning: train what the finished runs unlock until every group is decided."""
    out_dir = Path(output if output is not None else exp.output)
    plan = Plan(exp, out_dir, tasks=tasks, methods=methods, settings=settings, seeds=seeds, archive=archive)
    run = ExperimentRun(out_dir, plan.todo())
    if dry_run:
        for key, g in plan.groups.items():
            tried = ", ".join(f"{lr:g}: {'todo' if v is None else f'{v:.4f}'}" for lr, v in sorted(g.tried.items()))
            state = f"chosen lr {g.chosen:g}" if g.chosen is not None else "tuning"
            log(f"[experiment] {'__'.join(key)}: {state}; tuning runs {{{tried}}}; {len(g.todo)} run(s) to do")
        return run
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "experiment.json", {
        "name": exp.name, "source": str(exp.path) if exp.path else None, "overrides": exp.overrides,
        "lrs": exp.lrs, "method_lrs": exp.method_lrs, "tune": dataclasses.asdict(exp.tune)})
    waited = False
    while not tables_only:
        plan = Plan(exp, out_dir, tasks=tasks, methods=methods, settings=settings, seeds=seeds,
                    failed=list(run.failures), archive=archive)
        todo = plan.todo()
        cell = next((c for c in todo if claim(Path(c.config.output))), None)
        if cell is not None and cell.id in (*run.ran, *run.skipped):  # would loop forever
            release(Path(cell.config.output))
            raise RuntimeError(f"prismdp experiment: the plan asks again for {cell.id}, which this process already "
                               "trained or skipped (a bug: please report it)")
        if cell is None:
            if not todo:
                break
            if not waited:
                log(f"[experiment] {len(todo)} cell(s) left, all being trained by other processes; waiting for "
                    "their results (they decide what comes next)")
                waited = True
            time.sleep(poll_s)
            continue
        waited = False
        tag = f"[experiment] ({len(todo)} to do) {cell.id}"
        try:
            _train_cell(cell, run, train_fn, progress, log, tag, archive)
        finally:
            release(Path(cell.config.output))
        _write_tuned_tables(exp, out_dir, run.failures, archive)
    run.table = _write_tuned_tables(exp, out_dir, run.failures, archive)
    log(f"[experiment] {len(run.ran)} trained, {len(run.failures)} failed; results in {out_dir / 'results.md'}")
    return run


def honest_cells(exp: Experiment, out_dir: Path, *, tasks=None, methods=None, settings=None, seeds=None) -> List[Cell]:
    """``tune: {by: honest}``: one cell per (task, method, setting, seed), without the lr axis (its rates are the
    candidates of the cell's own ``prismdp tune``), in the grid's order."""
    exp.cells(str(out_dir), tasks=tasks, methods=methods, settings=settings, seeds=seeds)  # validates the selection
    return [exp.cell(t, m, s, seed, out_dir) for t in exp.tasks for s in exp.settings for m in exp.methods
            for seed in exp.seeds
            if (not tasks or t in tasks) and (not methods or m in methods) and (not settings or s in settings)
            and (not seeds or seed in seeds) and not exp.excluded(cell_id(t, m, s, seed, None))]


def _run_honest(exp: Experiment, *, output, tasks, methods, settings, seeds, dry_run, tables_only, progress, log,
                train_fn, archive) -> ExperimentRun:
    """Every cell a ``prismdp tune`` over the lr axis (:mod:`prismdp.experiment.honest`) with the cell's seed as its
    tune seed (the methods of one seed face the same draws); a cell is done when its tuning has released."""
    from .honest import Space, parse_trials, run_tuning

    out_dir = Path(output if output is not None else exp.output)
    run = ExperimentRun(out_dir, honest_cells(exp, out_dir, tasks=tasks, methods=methods, settings=settings,
                                              seeds=seeds))

    def tune(cell: Cell, tag: str) -> None:
        if is_done(cell, archive):
            run.skipped.append(cell.id)
            log(f"{tag}: done, skipped")
            return
        try:
            space = Space(tuple(exp.lrs_for(cell.method)))
            count, grid = parse_trials(str(exp.tune.trials), space)
            log(f"{tag}: tuning ({exp.tune.trials} over {len(space.lrs)} rates) -> {cell.config.output}")
            run_tuning(cell.config, space, count, score_noise=exp.tune.score_noise, tune_seed=cell.seed,
                       resume=True, grid=grid, progress=progress, log=log, train_fn=train_fn)
            run.ran.append(cell.id)
        except Exception as e:  # noqa: BLE001 - one failing cell must not stop the grid
            run.failures[cell.id] = f"{type(e).__name__}: {e}"
            log(f"{tag}: FAILED {type(e).__name__}: {e}")

    _run_cells(exp, run, honest_cells(exp, out_dir), dry_run=dry_run, tables_only=tables_only, log=log,
               archive=archive, verb="tuned", work=tune, lrs=exp.lrs, method_lrs=exp.method_lrs,
               tune=dataclasses.asdict(exp.tune))
    if dry_run:
        return run
    log(f"[experiment] {len(run.ran)} tuned, {len(run.skipped)} skipped, {len(run.failures)} failed; results in "
        f"{out_dir / 'results.md'}")
    return run
