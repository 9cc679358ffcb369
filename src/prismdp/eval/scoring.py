"""Scoring generations against gold answers.

GLUE (official validation splits; MNLI matched and mismatched): the generation is mapped to a label by
:func:`prismdp.eval.answers.parse_glue_label` and scored with :func:`prismdp.eval.metrics.glue_metrics` /
:func:`~prismdp.eval.metrics.main_score`.  An unparseable generation is counted (``unparsed``) and, with the
default ``unparsed="wrong"``, scored as a certainly wrong prediction: the next class ``(gold + 1) % k`` (so it is
wrong for accuracy, F1 and MCC alike) and, for STS-B, the end of [0, 5] farther from the gold score.
``unparsed="fallback"`` reproduces the PRISM reference code instead (label 0 / score 0.0, which can be right by
chance).

Math (GSM8K, AQuA, MAWPS, SVAMP): exact answer accuracy under the LLM-Adapters protocol
(:func:`prismdp.eval.answers.math_accuracy`: last number, tolerance 1e-3; AQuA by ``aqua_rule``, default
``"first"`` = upstream LLM-Adapters' first capital A-E); unparseable generations count as wrong and are counted.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from ..data.tasks import glue_task
from .answers import AQUA_RULES, DEFAULT_AQUA_RULE, extract_answer, math_accuracy, parse_glue_label
from .metrics import glue_metrics, main_score

__all__ = ["UNPARSED_POLICIES", "evaluate_glue_generation", "evaluate_math_generation"]

UNPARSED_POLICIES = ("wrong", "fallback")


def _wrong_label(task: str, gold):
    glue = glue_task(task)
    if glue.is_regression:
        return 0.0 if float(gold) >= 2.5 else 5.0
    return (int(gold) + 1) % len(glue.label_names)


def evaluate_glue_generation(task: str, generations: Sequence[str], golds: Sequence[Any], *,
                             unparsed: str = "wrong", metric_task: Optional[str] = None) -> Dict[str, Any]:
    """GLUE metrics of generated label words (see the module doc for unparseable generations).

    ``task`` is the label parser's task (``mnli`` for both MNLI sets); ``metric_task`` the
    :func:`~prismdp.eval.metrics.glue_metrics` name (default ``task``; ``mnli`` -> ``mnli_matched``).
    Returns the metrics plus ``score`` (Table-2 number), ``n``, ``unparsed``, ``parse_rate``, ``unparsed_policy``
    and ``predictions`` (the parsed labels, ``None`` where unparseable).
    """
    if unparsed not in UNPARSED_POLICIES:
        raise ValueError(f"unparsed must be one of {UNPARSED_POLICIES}, got {unparsed!r}")
    gens, gs = list(generations), list(golds)
    if not gens or len(gens) != len(gs):
        raise ValueError(f"need as many generations as golds (got {len(gens)} and {len(gs)})")
    glue = glue_task(task)
    metric_task = metric_task or glue.eval_set_name(glue.eval_splits[0])
    parsed = [parse_glue_label(task, g) for g in gens]
    if glue.is_regression:
        golds_m = [float(g) for g in gs]
        fill = (lambda gold: _wrong_label(task, gold)) if unparsed == "wrong" else (lambda gold: 0.0)
    else:
        golds_m = [int(g) for g in gs]
        fill = (lambda gold: _wrong_label(task, gold)) if unparsed == "wrong" else (lambda gold: 0)
    preds = [p if p is not None else fill(g) for p, g in zip(parsed, golds_m)]
    metrics = glue_metrics(metric_task, golds_m, preds)
    n_bad = sum(p is None for p in parsed)
    return {**metrics, "score": main_score(metric_task, metrics), "n": len(gens), "unparsed": n_bad,
            "parse_rate": 1.0 - n_bad / len(gens), "unparsed_policy": unparsed, "predictions": parsed}


def evaluate_math_generation(dataset: str, generations: Sequence[str], golds: Sequence[Any], *,
                             aqua_rule: str = DEFAULT_AQUA_RULE) -> Dict[str, Any]:
    """LLM-Adapters exact-answer accuracy: ``accuracy``/``score``, ``n``, ``correct``, ``unparsed`` (+ AQuA rule),
    and ``predictions`` (the answer read from each generation, None where none was found)."""
    if aqua_rule not in AQUA_RULES:
        raise ValueError(f"aqua_rule must be one of {AQUA_RULES}, got {aqua_rule!r}")
    res = dict(math_accuracy(dataset, list(generations), list(golds), aqua_rule=aqua_rule))
    res["predictions"] = [extract_answer(dataset, g, aqua_rule) for g in generations]
    res["score"] = res["accuracy"]
    res["parse_rate"] = 1.0 - res["unparsed"] / res["n"]
    if dataset.lower() == "aqua":
        res["aqua_rule"] = aqua_rule
    return res
