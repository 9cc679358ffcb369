"""A grid's finished cells read back from an earlier ``results.csv`` instead of their run folders.

For a grid split across machines (each writes its own ``results.csv``) or whose run folders were deleted::

    prismdp experiment GRID.yaml --results-from other/results.csv [--results-from ...]

A cell found in one of the files counts as done (it is not trained again) and is reported from its rows; a cell
whose own run folder holds a ``summary.json`` is read from the folder instead.  ``results.csv`` keeps what the
tables and the tuning need: each table column's score, each eval set's metrics, the privacy spent, the steps, the
step time, the peak memory and the evaluation time.  It does not keep the whole configuration: a row is checked
against its grid cell on what it does carry (steps, privacy target, learning rate, seed; the cell id encodes the
task, method and setting) and a disagreement is an error that names the file and the cell.  The merged tables and
``results.csv`` are written to the grid's output folder as usual.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..train.config import ConfigError

__all__ = ["Archive", "ArchivedRun"]


@dataclass
class ArchivedRun:
    source: Path
    row: Dict[str, str]  # the cell's first row: the per-cell fields (steps, privacy, timing)
    scores: Dict[str, float] = field(default_factory=dict)  # table column -> score
    evals: Dict[str, Dict[str, float]] = field(default_factory=dict)  # eval set -> metric -> value

    @cached_property
    def summary(self) -> Dict[str, Any]:
        """The parts of the run's ``summary.json`` that results.csv kept (built once, on first use)."""
        r = self.row
        private = r.get("dp") == "True"
        privacy: Dict[str, Any] = {"private": private}
        if private:
            privacy.update(epsilon=_num(r["epsilon_spent"]), delta=_num(r["delta"]),
                           noise_multiplier=_num(r["noise_multiplier"]))
        evals = {name: dict(m) for name, m in self.evals.items()}
        for name, m in evals.items():
            if "score" not in m:  # results.csv keeps the metrics, not the eval set's score
                m.update(_recomputed_score(r["task"], name, m))
        return {"steps": _int(r.get("steps")), "privacy": privacy, "eval": evals, "scores": dict(self.scores),
                "eval_time_s": _num(r.get("eval_time_s")), "train": {"peak_memory_mb": _num(r.get("peak_memory_mb"))},
                "results_from": str(self.source)}

    def config(self) -> Dict[str, Any]:
        return {"lr": _num(self.row.get("lr")), "model": self.row.get("model") or None}

    @property
    def mean_step_time_s(self) -> Optional[float]:
        return _num(self.row.get("mean_step_time_s"))


class Archive:
    """Cell id -> the run kept in one of several ``results.csv`` files (the first file that has the cell wins)."""

    def __init__(self, paths: Sequence[Path] = ()):
        self.runs: Dict[str, ArchivedRun] = {}
        for path in map(Path, paths):
            if not path.is_file():
                raise FileNotFoundError(f"--results-from {path}: no such file (a results.csv written by "
                                        "prismdp experiment)")
            mine: Dict[str, ArchivedRun] = {}
            with open(path, newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                need = {"cell_id", "task", "column", "metric", "value", "steps", "dp", "epsilon_target", "seed", "lr"}
                if not need <= set(reader.fieldnames or ()):
                    raise ConfigError(f"--results-from {path}: not a results.csv of prismdp experiment (columns "
                                      f"{sorted(need - set(reader.fieldnames or ()))} missing)")
                for row in reader:
                    run = mine.setdefault(row["cell_id"], ArchivedRun(path, row))
                    value = _value(row["value"])
                    if row["metric"] == "score":
                        run.scores[row["column"]] = value
                    else:
                        run.evals.setdefault(row["column"], {})[row["metric"]] = value
            for cid, run in mine.items():
                self.runs.setdefault(cid, run)

    def __bool__(self) -> bool:
        return bool(self.runs)

    def get(self, cell) -> Optional[ArchivedRun]:
        """The archived run of ``cell`` (checked against it), or None."""
        run = self.runs.get(cell.id)
        if run is None:
            return None
        r, cfg = run.row, cell.config
        diffs: List[str] = []
        if _int(r.get("steps")) != cfg.steps:
            diffs.append(f"steps {r.get('steps')} vs {cfg.steps}")
        eps = _num(r.get("epsilon_target"))
        if (eps is None) != (not cell.setting.dp) or (eps is not None and not math.isclose(eps, cell.setting.epsilon)):
            diffs.append(f"privacy target {r.get('epsilon_target') or 'non-dp'} vs {cell.setting.key}")
        if _int(r.get("seed")) != cell.seed:
            diffs.append(f"seed {r.get('seed')} vs {cell.seed}")
        lr = _num(r.get("lr"))
        if cfg.lr is not None and (lr is None or not math.isclose(lr, cfg.lr, rel_tol=1e-9)):
            diffs.append(f"lr {r.get('lr')} vs {cfg.lr}")
        if diffs:
            raise ConfigError(f"--results-from {run.source}: cell {cell.id} differs from the grid's "
                              f"({'; '.join(diffs)}); drop the file or run the grid it came from")
        return run


def _recomputed_score(task: Optional[str], name: str, metrics: Dict[str, float]) -> Dict[str, float]:
    """An eval set's ``score`` as the trainer computes it (:func:`prismdp.eval.metrics.main_score` of the set's
    metrics, which results.csv keeps): a set named after a GLUE eval set (generation runs) is scored as that set, the
    eval sets of a GLUE classification run (``validation``, ``val``, ``test``) as the task's first eval set.  Other
    sets keep no score (their accuracy stands for it, as in :func:`prismdp.experiment.tuning.eval_score`)."""
    from ..data.tasks import GLUE_EVAL_SETS, GLUE_TASKS, glue_task
    from ..eval.metrics import main_score

    if name in GLUE_EVAL_SETS:
        metric_task = name
    elif task in GLUE_TASKS:
        glue = glue_task(task)
        metric_task = glue.eval_set_name(glue.eval_splits[0])
    else:
        return {}
    try:
        return {"score": main_score(metric_task, metrics)}
    except ValueError:  # a metric of the score is not in the file
        return {}


def _value(text: str) -> float:
    """A metric as written (counts such as ``n`` stay integers, so the merged results.csv reads as the original)."""
    return int(text) if text.lstrip("-").isdigit() else float(text)


def _num(v: Any) -> Optional[float]:
    if v is None or v == "":
        return None
    return float(v)


def _int(v: Any) -> Optional[int]:
    f = _num(v)
    return None if f is None else int(f)
