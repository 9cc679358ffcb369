"""The test sets of generation-based evaluation: their names (the registry's: :mod:`prismdp.data.tasks`), where
their files are found, and their records as prompts with gold answers.

Eval-set names (``TrainConfig.eval_tasks``): the GLUE tasks ``cola sst2 mrpc stsb qqp mnli qnli rte`` (``mnli`` =
both validation sets), the math sets ``gsm8k aqua mawps svamp``, and the groups ``glue8`` and ``math``
(:func:`prismdp.data.tasks.expand_eval_tasks`).  GLUE sets are the official validation splits, written as the GLUE8
instruction records (:func:`prismdp.data.glue8.to_instruct_record`) with an empty output; math sets are the
LLM-Adapters test files, whose gold answer is the record's ``answer`` (its ``output`` is an archived model response,
not gold).  :func:`resolve_eval_sets` finds the files under an eval-data folder and reports the ones it cannot find
(e.g. QQP validation, absent from ``/work/shared/data``) instead of failing, unless none is found at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..data.glue import load_glue
from ..data.glue8 import to_instruct_record
from ..data.instruct import generate_prompt, load_instruct_json
from ..data.tasks import MATH_DATASETS, MATH_SETS, expand_eval_tasks, glue_task

__all__ = ["EvalSet", "resolve_eval_sets"]


@dataclass
class EvalSet:
    """One test set: ``records`` are LLM-Adapters records (``output`` empty) with their ``gold`` answer."""

    name: str  # set name: "cola", "mnli_matched", "gsm8k", ...
    kind: str  # "glue" | "math"
    task: str  # GLUE task (label parser) or math dataset key
    records: List[Dict[str, Any]] = field(repr=False)
    golds: List[Any] = field(repr=False)
    source: str = ""
    total: int = 0  # size of the full set (before the limit)

    def prompts(self) -> List[str]:
        return [generate_prompt({**r, "output": ""}) for r in self.records]


def _find_math_file(name: str, roots: Sequence[Path]) -> Optional[Path]:
    up = MATH_DATASETS[name].folder
    for root in roots:
        for cand in (root / f"{name}_test.json", root / "math" / f"{name}_test.json", root / up / "test.json",
                     root / name / "test.json", root / "dataset" / up / "test.json"):
            if cand.is_file():
                return cand
    return None


def _glue_roots(root: Path) -> List[Path]:
    return [root] + ([root / "glue"] if (root / "glue").is_dir() else [])


def _load_glue_split(task: str, split: str, roots: Sequence[Path]):
    last: Optional[Exception] = None
    for root in roots:
        try:
            return load_glue(task, split, root), str(root) if root is not None else "hub"
        except FileNotFoundError as e:
            last = e
    raise FileNotFoundError(str(last) if last else f"no GLUE data for {task} {split}")


def resolve_eval_sets(names: Union[str, Sequence[str], None], eval_data: Union[str, os.PathLike, None], *,
                      limit: Optional[int] = None, log: Callable[[str], None] = lambda m: None
                      ) -> Tuple[List[EvalSet], Dict[str, str]]:
    """Load the requested test sets from ``eval_data`` -> (sets found, {missing set: reason}).

    GLUE validation data is looked up with :func:`prismdp.data.load_glue` under ``eval_data`` or
    ``eval_data/glue`` (``eval_data=None``: from the Hub); math test files as ``<name>_test.json`` (in ``eval_data``
    or ``eval_data/math``) or in LLM-Adapters' layout ``[dataset/]<gsm8k|AQuA|mawps|SVAMP>/test.json``.
    ``limit`` keeps the first ``limit``
    examples of each set.  Raises ``FileNotFoundError`` if sets were requested and none was found, ``ValueError``
    for malformed files.
    """
    wanted = expand_eval_tasks(names)
    if not wanted:
        return [], {}
    if eval_data is None:  # GLUE from the Hugging Face Hub (online users); math files need a folder
        root, roots = None, [None]
    else:
        root = Path(eval_data).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"eval_data {root} is not a folder (expected the GLUE root and/or the folder of "
                                    "the math <set>_test.json files)")
        roots = _glue_roots(root)
    sets: List[EvalSet] = []
    missing: Dict[str, str] = {}
    for name in wanted:
        if name in MATH_SETS:
            path = _find_math_file(name, [root]) if root is not None else None
            if path is None:
                missing[name] = (f"no {name} test file under {root} ({name}_test.json, math/{name}_test.json or "
                                 f"{MATH_DATASETS[name].folder}/test.json)" if root is not None else
                                 "math test sets need eval_data (the folder of <set>_test.json)")
                continue
            recs = load_instruct_json(path)
            if any("answer" not in r for r in recs):
                raise ValueError(f"{path}: math test records need the gold 'answer' field (LLM-Adapters test.json)")
            total = len(recs)
            recs = recs[:limit] if limit else recs
            sets.append(EvalSet(name, "math", name, [{**r, "output": ""} for r in recs],
                                [r["answer"] for r in recs], str(path), total))
            continue
        glue = glue_task(name)
        for split in glue.eval_splits:
            set_name = glue.eval_set_name(split)
            try:
                exs, src = _load_glue_split(name, split, roots)
            except FileNotFoundError as e:
                missing[set_name] = str(e)
                continue
            total = len(exs)
            exs = exs[:limit] if limit else exs
            sets.append(EvalSet(set_name, "glue", name, [{**to_instruct_record(name, ex), "output": ""} for ex in exs],
                                [ex.label for ex in exs], src, total))
    if not sets:
        raise FileNotFoundError(f"none of the eval sets {', '.join(wanted)} was found under {root or 'the Hub'}: "
                                + "; ".join(f"{k}: {v}" for k, v in missing.items()))
    for k, v in missing.items():
        log(f"[prismdp] eval set {k} is missing and will be reported as such: {v}")
    return sets, missing
