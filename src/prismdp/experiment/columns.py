"""The columns of the experiment tables (the paper's Table 2 layout): which number of a run's evaluation goes into
which column, the columns' display names, their groups and their order."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..data.tasks import GLUE8_TASKS, MATH_SETS
from ..eval.metrics import mnli_score

__all__ = ["table_scores", "reported_eval_set", "COLUMN_LABELS", "GROUPS", "CANONICAL"]

COLUMN_LABELS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP", "mnli": "MNLI",
                 "qnli": "QNLI", "rte": "RTE", "gsm8k": "GSM8K", "aqua": "AQuA", "mawps": "MAWPS", "svamp": "SVAMP",
                 "synthetic": "Synthetic"}
GROUPS = (("GLUE8", GLUE8_TASKS), ("Math-10K", MATH_SETS))
CANONICAL = (*GLUE8_TASKS, *MATH_SETS, "synthetic")


def table_scores(evals: Dict[str, Dict[str, Any]], task: Optional[str] = None) -> Dict[str, float]:
    """Table-2 columns of one run's evaluation: ``{column: score}``.

    Generation sets map to their own names (``cola`` ... ``rte``, ``gsm8k`` ... ``svamp``), with ``mnli`` = mean of
    the matched and mismatched accuracies (only if both were evaluated).  Classification runs (``task`` = the
    trained GLUE task) map ``validation`` (or ``test``, a split held out of the training data in its place) ->
    ``task``, ``validation_matched``/``_mismatched`` -> ``mnli`` (their mean; the matched accuracy when only it was
    evaluated), and the synthetic task's ``test`` -> ``synthetic`` (accuracy).  ``val`` (a tuning split) is never a
    column.
    """
    cols: Dict[str, float] = {}
    reported = reported_eval_set(evals, task)
    for name, ev in evals.items():
        if not isinstance(ev, dict) or ev.get("score", ev.get("accuracy")) is None:
            continue
        if name in GLUE8_TASKS or name in MATH_SETS:
            cols[name] = float(ev["score"])
        elif name == "test" and task == "synthetic":
            cols["synthetic"] = float(ev["accuracy"])
        elif name == reported:
            cols[task] = float(ev.get("score", ev.get("accuracy")))
    pairs = (("mnli_matched", "mnli_mismatched"), ("validation_matched", "validation_mismatched"))
    for a, b in pairs:
        if a in evals and b in evals:
            cols["mnli"] = mnli_score(evals[a], evals[b])
        elif a in evals and a == "validation_matched" and isinstance(evals[a], dict):
            cols["mnli"] = float(evals[a].get("accuracy", evals[a].get("score")))
    return cols


def reported_eval_set(evals: Dict[str, Dict[str, Any]], task: Optional[str]) -> Optional[str]:
    """The eval set behind a classification run's own column (``task``): ``validation`` or ``test`` (a split held out
    of the training data in its place), the later one where a run has both; None where there is none."""
    names = [n for n, ev in evals.items() if n in ("validation", "test") and isinstance(ev, dict)
             and ev.get("score", ev.get("accuracy")) is not None]
    return names[-1] if names and task is not None else None
