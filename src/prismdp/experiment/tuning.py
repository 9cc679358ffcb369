"""Learning-rate tuning inside a grid: the same tuning budget for every method, chosen on held-out training data.

With an lr axis and ``tune`` in the experiment file::

    lrs: [3.0e-4, 1.0e-3, 3.0e-3, 1.0e-2]
    tune: {by: val, widen: 2}          # seed: the tuning seed (default: the first of `seeds`)

(``tune: {by: honest, trials: grid}`` instead makes every cell its own ``prismdp tune``, paid for inside its epsilon:
:mod:`prismdp.experiment.honest`, docs/tuning.md.)  With ``by: val``, every (task, method, privacy setting) group
first trains at each rate with the tuning seed.  The rate whose run scores
best on the eval set ``by`` (a split carved from the training data, ``holdout_val``; never the reported dev set:
a ``by`` the tables report, or ``val`` in a cell without ``holdout_val``, is refused when the file is loaded) is
chosen; if it is the smallest or largest rate tried, one more rate on that side is tried, up to ``widen`` times per
side (the grid's mean log spacing, rounded to one significant digit: 1e-2 -> 3e-2 -> 1e-1).  Then the other seeds
run at the chosen rate; the tables report those runs (the tuning seed's run at the chosen rate is one of them).

:class:`Plan` turns the finished runs on disk into the cells still to train, in order: task by task (the grid's task
order), the tuning runs before the runs they unlock.  Several ``prismdp experiment`` processes can share a grid: the
runner claims a cell before training it (``.claim`` in its folder) and the others pass over it.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..data.tasks import GLUE_EVAL_SETS, GLUE_TASKS, MATH_SETS, TASKS
from ..train.config import ConfigError
from .columns import table_scores

__all__ = ["Tune", "Plan", "GroupState", "next_lr", "eval_score", "is_done"]


@dataclass(frozen=True)
class Tune:
    by: str = "val"  # the eval set that picks the rate (not "on": YAML 1.1 reads that key as true); or "honest"
    seed: Optional[int] = None
    widen: int = 2
    trials: Optional[str] = None  # by: honest: prismdp tune's --trials (grid, fixed:K, geometric:MEAN, ...)
    score_noise: float = 10.0  # by: honest: prismdp tune's --score-noise

    @property
    def honest(self) -> bool:
        """``by: honest``: every (task, method, setting, seed) cell is a ``prismdp tune`` over the lr axis, paid for
        inside the cell's epsilon (:mod:`prismdp.experiment.honest`), instead of rates chosen outside the budget."""
        return self.by == "honest"

    @classmethod
    def parse(cls, raw: Any, lrs: Optional[Sequence[float]]) -> "Tune":
        if not isinstance(raw, dict):
            raise ConfigError(f"tune: expected a mapping such as {{by: val, widen: 2}}, got {raw!r}")
        unknown = sorted(set(map(str, raw)) - {"by", "seed", "widen", "trials", "score_noise"})
        if unknown:
            raise ConfigError(f"tune: unknown key(s) {unknown}; valid: by, seed, widen, trials, score_noise")
        if not lrs or len(lrs) < 2:
            raise ConfigError("tune: needs an lr axis with at least two rates (lrs: [...])")
        t = cls(str(raw.get("by", "val")), raw.get("seed"), int(raw.get("widen", 2)), raw.get("trials"),
                float(raw.get("score_noise", 10.0)))
        if t.widen < 0:
            raise ConfigError(f"tune.widen must be >= 0, got {t.widen}")
        if t.honest:
            extra = sorted({"seed", "widen"} & set(map(str, raw)))
            if extra:
                raise ConfigError(f"tune: by: honest takes no {', '.join(extra)} (each seed's cell tunes itself over "
                                  "the lr axis as declared; widening it after seeing scores would not be paid for)")
            if t.trials is None:
                raise ConfigError("tune: by: honest needs trials: grid (every rate once), fixed:K, geometric:MEAN, "
                                  "negative-binomial:SHAPE:MEAN, logarithmic:MEAN or poisson:MEAN (docs/tuning.md)")
            from ..privacy.tuning import TrialCount

            if str(t.trials) != "grid":
                try:
                    TrialCount.parse(str(t.trials))
                except ValueError as e:
                    raise ConfigError(f"tune.trials: {e}") from None
        elif "trials" in raw or "score_noise" in raw:
            raise ConfigError("tune: trials and score_noise apply to by: honest")
        return t

    def check_split(self, cells) -> None:
        """Refuse, when the grid is loaded, a tuning set that cannot choose a rate honestly: one whose score a table
        reports (the rate would be selected on the reported numbers), any set but ``val`` (no other eval set is held
        out of the training data), and ``val`` where a cell carves none (every rate would score NaN)."""
        fix = ("tune on training examples held out of training: tune: {by: val} with holdout_val: N (e.g. 1000) in "
               "base or in each task")
        split = "val" if self.honest else self.by
        for cell in cells:
            if self.honest and not cell.config.dp:
                raise ConfigError(f"tune: by: honest pays for the choice inside a privacy budget, but cell {cell.id} "
                                  "is non-private: drop non-dp from privacy, or tune it in a grid with by: val")
            column = _reported_column(split, cell.config.task)
            if column is not None:
                raise ConfigError(f"tune: by: {self.by!r} is an eval set the tables report (the {column} column of "
                                  f"cell {cell.id}); choosing the rate on it would select on the reported numbers. "
                                  f"Instead {fix}")
            if split != "val":
                raise ConfigError(f"tune: by: {self.by!r}: no run of this grid evaluates such an eval set (cell "
                                  f"{cell.id}); {fix}")
            if not cell.config.holdout_val:
                if TASKS[cell.config.task].glue is None:
                    raise ConfigError(f"tune: task {cell.config.task!r} (cell {cell.id}) has no held-out tuning "
                                      "split (holdout_val applies to GLUE classification tasks): give it a fixed lr "
                                      "in a grid without tune")
                raise ConfigError(f"tune: by: val needs holdout_val in every tuned cell, but cell {cell.id} (task "
                                  f"{cell.task_id!r}) has none: its runs would evaluate no val split, every rate "
                                  f"would score NaN and the smallest would be chosen. Add holdout_val: N (e.g. 1000) "
                                  f"to base or to tasks.{cell.task_id}")


@functools.lru_cache(maxsize=None)
def _reported_column(name: str, task: str) -> Optional[str]:
    """The table column that eval set ``name`` of a ``task`` run feeds, if any: a column that moves when that set's
    score moves, the set alone or beside any other eval set a run can hold (MNLI's column needs both halves)."""
    others = {"val", "test", *GLUE_EVAL_SETS, *MATH_SETS, *(s for t in GLUE_TASKS.values() for s in t.eval_splits)}
    for other in [None, *sorted(others - {name})]:
        evals = {} if other is None else {other: {"score": 0.5, "accuracy": 0.5}}
        before = table_scores({**evals, name: {"score": 0.5, "accuracy": 0.5}}, task)
        after = table_scores({**evals, name: {"score": 0.75, "accuracy": 0.75}}, task)
        moved = [c for c in after if after[c] != before.get(c)]
        if moved:
            return moved[0]
    return None


def next_lr(lrs: Sequence[float], side: str) -> float:
    """The rate one step beyond the ``side`` ('low' or 'high') end of the sorted ``lrs``, at their mean log spacing,
    snapped to the nearest 1 x 10^k or 3 x 10^k (the usual log-spaced ladder 1e-3, 3e-3, 1e-2, ...)."""
    ratio = (lrs[-1] / lrs[0]) ** (1 / (len(lrs) - 1))
    value = lrs[0] / ratio if side == "low" else lrs[-1] * ratio
    k = math.floor(math.log10(value))
    ladder = [m * 10.0 ** e for e in (k - 1, k, k + 1) for m in (1, 3)]
    return float(f"{min(ladder, key=lambda v: abs(math.log10(v / value))):.0e}")


def eval_score(cell, on: str, archive=None) -> Optional[float]:
    """The run's score on eval set ``on`` (its ``score``, else ``accuracy``); None if unfinished, NaN if not evaluated.
    A cell without a run folder is looked up in ``archive`` (an earlier results.csv, :mod:`.archive`)."""
    path = Path(cell.config.output) / "summary.json"
    if path.is_file():
        evals = json.loads(path.read_text()).get("eval") or {}
    else:
        kept = archive.get(cell) if archive else None
        if kept is None:
            return None
        evals = kept.summary["eval"]
    ev = evals.get(on)
    if not isinstance(ev, dict):
        return math.nan
    v = ev.get("score", ev.get("accuracy"))
    return float(v) if isinstance(v, (int, float)) else math.nan


def is_done(cell, archive=None) -> bool:
    """Finished: its run folder has a summary.json, or ``archive`` keeps its results."""
    return (Path(cell.config.output) / "summary.json").is_file() or bool(archive and archive.get(cell))


@dataclass
class GroupState:
    """What is known of one (task, method, setting) group."""

    key: Tuple[str, str, str]
    tried: Dict[float, Optional[float]] = field(default_factory=dict)  # lr -> tuning score (None: not done)
    chosen: Optional[float] = None
    todo: List[Any] = field(default_factory=list)  # cells to train next
    seed_cells: List[Any] = field(default_factory=list)  # at the chosen rate, every seed (reported)


class Plan:
    """The tuned grid's state, recomputed from the run folders (so it resumes, and processes can share it)."""

    def __init__(self, exp, out_root: Path, *, tasks=None, methods=None, settings=None, seeds=None,
                 failed: Sequence[str] = (), archive=None):
        self.exp, self.out_root, self.failed, self.archive = exp, Path(out_root), set(failed), archive
        self.tune = exp.tune
        self.tune_seed = self.tune.seed if self.tune.seed is not None else exp.seeds[0]
        if self.tune_seed not in exp.seeds:
            raise ConfigError(f"tune.seed {self.tune_seed} is not one of the seeds {exp.seeds}")
        self.tasks = [t for t in exp.tasks if not tasks or t in tasks]
        self.methods = [m for m in exp.methods if not methods or m in methods]
        self.settings = [s for s in exp.settings if not settings or s in settings]
        # ``seeds``: the seeds whose runs at the chosen rate are trained (the tuning runs, at ``tune_seed``, always are:
        # without them there is no chosen rate)
        exp.check_seeds(seeds)
        self.seeds = [s for s in exp.seeds if not seeds or s in seeds]
        self.groups: Dict[Tuple[str, str, str], GroupState] = {}
        self.refresh()

    def _cell(self, task_id, method, setting, seed, lr):
        return self.exp.cell(task_id, method, setting, seed, self.out_root, lr)

    def _score(self, cell) -> Optional[float]:
        if cell.id in self.failed:
            return -math.inf  # a failed run does not win, and is not retried by this process
        return eval_score(cell, self.tune.by, self.archive)

    def _group(self, task_id, method, setting) -> Optional[GroupState]:
        """The group's state; None when the experiment's ``exclude`` leaves it out."""
        g = GroupState((task_id, method, setting.key))
        lrs = sorted(self.exp.lrs_for(method))
        widened = {"low": 0, "high": 0}
        while True:
            cells = {lr: self._cell(task_id, method, setting, self.tune_seed, lr) for lr in lrs}
            if self.exp.excluded(next(iter(cells.values())).id):
                return None
            g.tried = {lr: self._score(c) for lr, c in cells.items()}
            missing = [c for lr, c in cells.items() if g.tried[lr] is None]
            if missing:
                g.todo = missing
                return g
            best = max(lrs, key=lambda lr: (_finite(g.tried[lr]), -lr))  # ties: the smaller rate
            side = "low" if best == lrs[0] else "high" if best == lrs[-1] else None
            if side is not None and widened[side] < self.tune.widen and math.isfinite(_finite(g.tried[best])):
                widened[side] += 1
                lrs = [next_lr(lrs, side)] + lrs if side == "low" else lrs + [next_lr(lrs, side)]
                continue
            g.chosen = best
            g.seed_cells = [self._cell(task_id, method, setting, s, best) for s in self.exp.seeds]
            g.todo = [c for s, c in zip(self.exp.seeds, g.seed_cells)
                      if s in self.seeds and not is_done(c, self.archive) and c.id not in self.failed]
            return g

    def refresh(self) -> None:
        self.groups = {}
        for task_id in self.tasks:
            for setting in self.settings:
                for method in self.methods:
                    g = self._group(task_id, method, setting)
                    if g is not None:
                        self.groups[g.key] = g

    def todo(self) -> List[Any]:
        """Cells to train now, in order: per task, the tuning runs of every group, then the runs they unlocked."""
        out = []
        for task_id in self.tasks:
            gs = [g for k, g in self.groups.items() if k[0] == task_id]
            out += [c for g in gs if g.chosen is None for c in g.todo]
            out += [c for g in gs if g.chosen is not None for c in g.todo]
        return out

    def done(self) -> bool:
        return all(g.chosen is not None and not g.todo for g in self.groups.values())

    def reported_cells(self) -> List[Any]:
        """Every seed at each group's chosen rate (what the tables report)."""
        return [c for g in self.groups.values() for c in g.seed_cells]

    def all_cells(self) -> List[Any]:
        """Every cell the plan has tried or will train (tuning and reported runs), for results.csv."""
        seen, out = set(), []
        for (task_id, method, skey), g in self.groups.items():
            setting = next(s for s in self.settings if s.key == skey)
            for c in [self._cell(task_id, method, setting, self.tune_seed, lr) for lr in sorted(g.tried)] \
                    + g.seed_cells:
                if c.id not in seen:
                    seen.add(c.id)
                    out.append(c)
        return out


def _finite(v: Optional[float]) -> float:
    return v if v is not None and not math.isnan(v) else -math.inf
