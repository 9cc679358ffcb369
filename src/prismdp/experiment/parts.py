"""The parts of a combined score, against the majority class.

QQP's and MRPC's score is the mean of accuracy and F1 on the positive class.  Under privacy a run can raise it by
saying "duplicate" (the minority class) more often without separating the classes: on QQP, always saying it scores
about 0.45 while always saying the majority class scores about 0.32, and neither learns anything.  This section of
``results.md`` shows, for every task column whose reported eval set has both accuracy and F1, each setting and
method's accuracy and F1 (mean ± sample std over seeds), the accuracy of always predicting the majority class of
that eval set, and how many runs' accuracy is above it.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from .columns import COLUMN_LABELS, reported_eval_set
from .grid import Cell, Experiment
from .records import CellResult, mean_sd

__all__ = ["render_parts"]


def render_parts(exp: Experiment, cells: Sequence[Cell], results: Sequence[CellResult]) -> str:
    """The section as markdown ('' when no reported eval set has both accuracy and F1), from the results of the
    reported cells."""
    by_cell = {r.cell.id: r for r in results}
    groups: Dict[Tuple[str, str, str], List[dict]] = {}
    for c in cells:
        r = by_cell.get(c.id)
        if r is None:
            continue
        evals = r.summary.get("eval") or {}
        name = reported_eval_set(evals, c.config.task)
        ev = evals.get(name) if name else None
        if isinstance(ev, dict) and "accuracy" in ev and "f1" in ev:
            groups.setdefault((c.task_id, c.setting.key, c.method), []).append(ev)
    if not groups:
        return ""
    lines = ["", "## Accuracy and F1 against the majority class", "",
             "For tasks scored by the mean of accuracy and F1: a private run can raise that score by predicting the "
             "minority class more often without separating the classes. Per setting and method, accuracy and F1 of "
             "the reported eval set (mean ± sample std over seeds), the accuracy of always predicting its majority "
             "class, and the runs whose accuracy is above it.", "",
             "| Task | Setting | Method | accuracy | F1 | majority class | runs above it |",
             "|---|---|---|---:|---:|---:|---:|"]
    for task_id in exp.tasks:
        for st in exp.settings:
            for method in exp.methods:
                evs = groups.get((task_id, st.key, method))
                if not evs:
                    continue
                majority = [ev.get("majority_baseline") for ev in evs]
                known = [m for m in majority if m is not None]
                above = sum(ev["accuracy"] > m for ev, m in zip(evs, majority) if m is not None)
                lines.append(f"| {COLUMN_LABELS.get(task_id, task_id)} | {st.label} | {exp.label(method)} | "
                             f"{mean_sd([ev['accuracy'] for ev in evs])} | {mean_sd([ev['f1'] for ev in evs])} | "
                             f"{_majority(known)} | " + (f"{above}/{len(known)}" if known else "–") + " |")
    return "\n".join(lines) + "\n"


def _majority(values: Sequence[float]) -> str:
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{lo:.3f}" if round(lo, 3) == round(hi, 3) else f"{lo:.3f}-{hi:.3f}"
