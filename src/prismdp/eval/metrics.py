"""GLUE metrics in plain numpy (no scikit-learn / scipy at runtime).

Every function takes two equal-length, non-empty 1-D sequences (``y_true`` first) and returns a Python
``float``; empty inputs, length mismatches and non-1-D inputs raise ``ValueError``.

Conventions
-----------
* ``matthews_corrcoef`` uses the confusion-matrix formula of scikit-learn (valid for any number of classes,
  so the binary case is the usual ``(TP*TN - FP*FN) / sqrt(...)``) and returns ``0.0`` when it is undefined
  (a constant ``y_true`` or ``y_pred``), exactly like ``sklearn.metrics.matthews_corrcoef``.
* ``f1_binary`` returns ``0.0`` when there is neither a true nor a predicted positive (sklearn's
  ``zero_division`` default).
* ``pearson`` / ``spearman`` return ``0.0`` when either input is constant.  scipy returns ``nan`` there;
  a constant predictor (e.g. a model that always answers "2.5" on STS-B) carries no linear or rank
  information, and ``0.0`` keeps the GLUE8 average finite (same convention as MCC).  Non-finite values
  raise ``ValueError``.  ``spearman`` gives tied values their average rank (scipy's ``rankdata`` default).

Table 2 of the PRISM paper reports one number per task.  The paper only says "standard GLUE metrics"; the
authors' released evaluator (osu-srml/PRISM-DP-LoRA, ``src/prism_cli/eval_glue.py``) computes, as the GLUE
leaderboard does, CoLA = MCC; SST-2, QNLI, RTE = accuracy; MRPC, QQP = (F1 + accuracy) / 2;
STS-B = (Pearson + Spearman) / 2; MNLI = (matched accuracy + mismatched accuracy) / 2; GLUE8 Avg = the
unweighted mean of those eight numbers.  :func:`main_score`, :func:`mnli_score` and :func:`glue8_scores`
implement that convention.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from ..data.tasks import GLUE8_TASKS, GLUE_EVAL_SETS, GlueTask, glue_eval_set

__all__ = [
    "matthews_corrcoef",
    "accuracy",
    "f1_binary",
    "pearson",
    "spearman",
    "rankdata",
    "glue_metrics",
    "main_score",
    "mnli_score",
    "glue8_scores",
]

# --------------------------------------------------------------------------------------------------------
# input checking
# --------------------------------------------------------------------------------------------------------
def _as_1d(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def _check_pair(y_true: Any, y_pred: Any) -> tuple[np.ndarray, np.ndarray]:
    t = _as_1d(y_true, "y_true")
    p = _as_1d(y_pred, "y_pred")
    if t.shape[0] == 0 or p.shape[0] == 0:
        raise ValueError("empty input: y_true and y_pred must be non-empty")
    if t.shape[0] != p.shape[0]:
        raise ValueError(f"length mismatch: len(y_true)={t.shape[0]} != len(y_pred)={p.shape[0]}")
    if (t.dtype.kind in "US") != (p.dtype.kind in "US"):
        # e.g. string labels ("entailment") against integer ids: every comparison would silently be False
        raise ValueError(f"label types differ: y_true dtype {t.dtype}, y_pred dtype {p.dtype}")
    return t, p


def _check_real_pair(y_true: Any, y_pred: Any) -> tuple[np.ndarray, np.ndarray]:
    t, p = _check_pair(y_true, y_pred)
    try:
        t = t.astype(np.float64)
        p = p.astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"pearson/spearman need real numbers: {exc}") from None
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(p))):
        raise ValueError("pearson/spearman inputs must be finite")
    return t, p


# --------------------------------------------------------------------------------------------------------
# classification metrics
# --------------------------------------------------------------------------------------------------------
def accuracy(y_true: Sequence[Any], y_pred: Sequence[Any]) -> float:
    """Fraction of positions where ``y_pred == y_true``."""
    t, p = _check_pair(y_true, y_pred)
    return float(np.mean(t == p))


def f1_binary(y_true: Sequence[Any], y_pred: Sequence[Any], positive: Any = 1) -> float:
    """F1 of the class ``positive`` (every other value counts as negative); 0.0 if TP + FP + FN == 0."""
    t, p = _check_pair(y_true, y_pred)
    tp_ = t == positive
    pp_ = p == positive
    tp = int(np.sum(tp_ & pp_))
    fp = int(np.sum(~tp_ & pp_))
    fn = int(np.sum(tp_ & ~pp_))
    denom = 2 * tp + fp + fn
    return 0.0 if denom == 0 else float(2 * tp / denom)


def matthews_corrcoef(y_true: Sequence[Any], y_pred: Sequence[Any]) -> float:
    """Matthews correlation coefficient (binary or multiclass); 0.0 when undefined, like sklearn."""
    t, p = _check_pair(y_true, y_pred)
    _, inv = np.unique(np.concatenate([t, p]), return_inverse=True)
    inv = inv.reshape(-1)
    n = t.shape[0]
    ti, pi = inv[:n], inv[n:]
    k = int(inv.max()) + 1
    cm = np.zeros((k, k), dtype=np.float64)
    np.add.at(cm, (ti, pi), 1.0)
    t_sum = cm.sum(axis=1)  # occurrences of each class in y_true
    p_sum = cm.sum(axis=0)  # occurrences of each class in y_pred
    c = np.trace(cm)
    s = float(n)
    cov_tp = c * s - float(t_sum @ p_sum)
    cov_pp = s * s - float(p_sum @ p_sum)
    cov_tt = s * s - float(t_sum @ t_sum)
    if cov_pp * cov_tt == 0.0:
        return 0.0
    return float(cov_tp / math.sqrt(cov_tt * cov_pp))


# --------------------------------------------------------------------------------------------------------
# correlation metrics
# --------------------------------------------------------------------------------------------------------
def _pearson_arrays(x: np.ndarray, y: np.ndarray) -> float:
    xc = x - x.mean()
    yc = y - y.mean()
    nx = math.sqrt(float(xc @ xc))
    ny = math.sqrt(float(yc @ yc))
    if nx == 0.0 or ny == 0.0:
        return 0.0
    r = float(xc @ yc) / (nx * ny)
    return max(-1.0, min(1.0, r))


def pearson(y_true: Sequence[float], y_pred: Sequence[float]) -> float:
    """Pearson correlation; 0.0 if either input is constant (scipy would return nan)."""
    t, p = _check_real_pair(y_true, y_pred)
    return _pearson_arrays(t, p)


def rankdata(x: Sequence[float]) -> np.ndarray:
    """1-based ranks with ties given their average rank (scipy.stats.rankdata(method='average'))."""
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    order = np.argsort(a, kind="mergesort")
    sa = a[order]
    new_group = np.empty(sa.shape[0], dtype=bool)
    if sa.shape[0]:
        new_group[0] = True
        new_group[1:] = sa[1:] != sa[:-1]
    group = np.cumsum(new_group) - 1  # group id of each sorted element
    starts = np.flatnonzero(new_group)  # 0-based start of each tie group
    ends = np.append(starts[1:], sa.shape[0])  # exclusive end
    avg = (starts + 1 + ends) / 2.0  # mean of the 1-based ranks start+1 .. end
    ranks = np.empty(sa.shape[0], dtype=np.float64)
    ranks[order] = avg[group]
    return ranks


def spearman(y_true: Sequence[float], y_pred: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson of average ranks); 0.0 if either input is constant."""
    t, p = _check_real_pair(y_true, y_pred)
    return _pearson_arrays(rankdata(t), rankdata(p))


# --------------------------------------------------------------------------------------------------------
# GLUE task mapping
# --------------------------------------------------------------------------------------------------------
def _check_task(task: str) -> GlueTask:
    """The GLUE task of an eval set named as in :data:`prismdp.data.tasks.GLUE_EVAL_SETS` (``mnli_matched``, ...)."""
    return glue_eval_set(task)[0]


def _f1(y_true, y_pred) -> float:
    return f1_binary(y_true, y_pred, positive=1)  # the GLUE label id of equivalent / duplicate


_METRICS = {"mcc": matthews_corrcoef, "accuracy": accuracy, "f1": _f1, "pearson": pearson, "spearman": spearman}


def glue_metrics(task: str, y_true: Sequence[Any], y_pred: Sequence[Any]) -> dict[str, float]:
    """Standard GLUE metrics of one eval set (the task's ``GlueTask.metrics``).

    cola -> {mcc}; sst2, mnli_matched, mnli_mismatched, qnli, rte -> {accuracy};
    mrpc, qqp -> {f1, accuracy} (positive class 1 = equivalent / duplicate, the GLUE label ids);
    stsb -> {pearson, spearman}.

    ``y_pred`` must not contain ``None``: decide explicitly how unparseable generations are scored (for
    example map them to a label that is certainly wrong, or to the fallback label of the authors' code,
    which is 0 / 0.0) before calling this.
    """
    glue = _check_task(task)
    t, p = _check_pair(y_true, y_pred)
    if any(v is None for v in p.tolist()) or any(v is None for v in t.tolist()):
        raise ValueError("y_true/y_pred contain None; map unparsed predictions to a label first")
    return {name: _METRICS[name](t, p) for name in glue.metrics}


def _get(metrics: Mapping[str, float], name: str, task: str) -> float:
    if name not in metrics:
        raise ValueError(f"metrics for {task!r} lack {name!r} (got {sorted(metrics)})")
    return float(metrics[name])


def main_score(task: str, metrics: Mapping[str, float]) -> float:
    """The single per-task number of the paper's Table 2 (GLUE leaderboard convention, see module doc): the mean of
    the eval set's metrics.

    cola: mcc; sst2 / mnli_matched / mnli_mismatched / qnli / rte: accuracy;
    mrpc / qqp: (f1 + accuracy) / 2; stsb: (pearson + spearman) / 2.
    The Table-2 MNLI column is :func:`mnli_score` (mean of matched and mismatched accuracy).
    """
    glue = _check_task(task)
    return sum(_get(metrics, name, task) for name in glue.metrics) / len(glue.metrics)


def mnli_score(matched: Mapping[str, float], mismatched: Mapping[str, float]) -> float:
    """Table-2 MNLI number: mean of the matched and mismatched validation accuracies."""
    return (_get(matched, "accuracy", "mnli_matched") + _get(mismatched, "accuracy", "mnli_mismatched")) / 2.0


def glue8_scores(metrics_by_task: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Table-2 GLUE8 row from per-set metric dicts (keys: the 9 eval sets of
    :data:`prismdp.data.tasks.GLUE_EVAL_SETS`).

    Returns ``{cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, avg}`` where ``avg`` is the unweighted mean of
    the eight columns.  Raises ``ValueError`` if a task is missing.
    """
    missing = [t for t in GLUE_EVAL_SETS if t not in metrics_by_task]
    if missing:
        raise ValueError(f"missing GLUE tasks: {', '.join(missing)}")
    row = {}
    for col in GLUE8_TASKS:
        if col == "mnli":
            row[col] = mnli_score(metrics_by_task["mnli_matched"], metrics_by_task["mnli_mismatched"])
        else:
            row[col] = main_score(col, metrics_by_task[col])
    row["avg"] = sum(row[c] for c in GLUE8_TASKS) / len(GLUE8_TASKS)
    return row
