"""What the experiment's tables are built from: one finished cell's results (:class:`CellResult`, read from its run
folder or an earlier ``results.csv`` by :func:`read_cell`), one paired comparison (:class:`Pair`) and the way the
sections print seeds' values (:func:`mean_sd`).  Kept apart from :mod:`prismdp.experiment.tables` so that the
sections it assembles (budget curves, the paired figure, the parts of combined scores) can use them without
importing the tables."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..train.profile import run_step_times
from .columns import table_scores
from .grid import Cell, Setting

__all__ = ["CellResult", "Pair", "mean_sd", "read_cell"]


@dataclass
class CellResult:
    cell: Cell
    summary: Dict[str, Any]
    config: Dict[str, Any]
    scores: Dict[str, float]
    mean_step_time_s: Optional[float] = None  # after the warm-up steps (prismdp.train.profile)
    missing: Dict[str, str] = field(default_factory=dict)
    peak_memory_mb: Optional[float] = None  # of the training steps (summary.json "train"; absent in older runs)


def read_cell(cell: Cell, archive=None) -> Optional[CellResult]:
    """The finished run of ``cell``: from its run folder, else from ``archive``
    (:class:`prismdp.experiment.archive.Archive`, an earlier results.csv); None if neither has it."""
    out = Path(cell.config.output)
    if not (out / "summary.json").is_file():
        kept = archive.get(cell) if archive else None
        if kept is None:
            return None
        return CellResult(cell, kept.summary, kept.config(), dict(kept.scores), kept.mean_step_time_s, {},
                          kept.summary["train"]["peak_memory_mb"])
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    scores = summary.get("scores")
    if scores is None:
        scores = table_scores(summary.get("eval", {}), cell.config.task)
    return CellResult(cell, summary, config, {k: float(v) for k, v in scores.items()},
                      run_step_times(out / "metrics.jsonl").get("mean_step_time_s"),
                      dict(summary.get("eval_missing", {})), (summary.get("train") or {}).get("peak_memory_mb"))


@dataclass
class Pair:
    """``compare`` minus ``method`` on one task column and setting, per seed both have."""
    name: str  # the task column ("sst2", or "id:column" when a task id has several)
    setting: Setting
    method: str
    seeds: List[int]
    diffs: List[float]


def mean_sd(values: Sequence[float]) -> str:
    """Seeds' values as the sections print them: ``mean ± sample std`` (3 decimals), the mean alone for one value,
    ``–`` for none."""
    if not values:
        return "–"
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) < 2 else f"{mean:.3f} ± {statistics.stdev(values):.3f}"
