"""The task registry: every task and evaluation set prismdp knows, declared once.  The configuration, the task data
(:mod:`prismdp.train.tasks`), the evaluation (:mod:`prismdp.eval`) and the experiment tables all read it.

* Training tasks (``TrainConfig.task``): :data:`TASKS`, name -> :class:`Task`: its family (which defaults of
  ``TrainConfig`` and which learning rates of a method apply), the model head it trains, and for a GLUE task its
  :class:`GlueTask`.
* GLUE: :data:`GLUE_TASKS`, name -> :class:`GlueTask`: columns, label words, metrics, splits (MNLI has two validation
  splits) and the official file layout :mod:`prismdp.data.glue` reads; :data:`GLUE_EVAL_SETS`: the validation sets
  by name (``cola``, ..., ``mnli_matched``, ``mnli_mismatched``, ...).
* Math test sets: :data:`MATH_DATASETS` (the answer a generation is read for, LLM-Adapters' folder);
  :data:`MATH_SETS` are the paper's four.
* Generation eval sets of the causal-LM tasks (``TrainConfig.eval_tasks``): the GLUE tasks, the math sets and the
  groups of :data:`EVAL_GROUPS`, validated by :func:`expand_eval_tasks`.

A new task is an entry here (plus, for a new kind of data, its reader in :mod:`prismdp.data` and its branch in
:func:`prismdp.train.tasks.build_task_data`).  Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["Task", "TASKS", "FAMILIES", "train_task", "GlueTask", "GLUE_TASKS", "GLUE8_TASKS", "GLUE_EVAL_SETS",
           "glue_task", "glue_eval_set", "MathDataset", "MATH_DATASETS", "MATH_SETS", "EVAL_GROUPS",
           "expand_eval_tasks"]


# ------------------------------------------------------------------------------------------------------------- GLUE


@dataclass(frozen=True)
class GlueTask:
    """Static description of one GLUE task.

    ``text_fields`` are the Hugging Face column names (one for single-sentence tasks, two for pair tasks);
    ``label_names`` follow the HF integer labels (``None`` for the STS-B regression); ``num_labels`` is 1 for
    STS-B.  ``tsv_columns`` = (text_a, text_b, label) header names of the official TSV (CoLA: column indices,
    the file has no header).  ``metrics``: what :func:`prismdp.eval.metrics.glue_metrics` reports; the task's
    Table-2 score is their mean (the GLUE leaderboard convention).
    """

    name: str
    dir_name: str
    text_fields: Tuple[str, ...]
    label_names: Optional[Tuple[str, ...]]
    num_labels: int
    is_regression: bool
    splits: Tuple[str, ...]
    tsv_columns: Tuple[Union[str, int, None], Union[str, int, None], Union[str, int]]
    tsv_has_header: bool = True
    tsv_num_columns: Optional[int] = None  # only for header-less files
    metrics: Tuple[str, ...] = ("accuracy",)

    @property
    def is_pair(self) -> bool:
        return len(self.text_fields) == 2

    @property
    def eval_splits(self) -> Tuple[str, ...]:
        """The labelled validation splits (MNLI: matched and mismatched)."""
        return tuple(s for s in self.splits if s != "train")

    def eval_set_name(self, split: str) -> str:
        """The name of a validation split as an eval set: the task's name, or ``mnli_matched`` / ``mnli_mismatched``."""
        return self.name if split == "validation" else f"{self.name}_{split.removeprefix('validation_')}"


_STD = ("train", "validation")
_MNLI = ("train", "validation_matched", "validation_mismatched")

GLUE_TASKS: Dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask("cola", "CoLA", ("sentence",), ("unacceptable", "acceptable"), 2, False, _STD,
                 (3, None, 1), tsv_has_header=False, tsv_num_columns=4, metrics=("mcc",)),
        GlueTask("sst2", "SST-2", ("sentence",), ("negative", "positive"), 2, False, _STD,
                 ("sentence", None, "label")),
        GlueTask("mrpc", "MRPC", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), 2, False, _STD,
                 ("#1 String", "#2 String", "Quality"), metrics=("f1", "accuracy")),
        GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), None, 1, True, _STD,
                 ("sentence1", "sentence2", "score"), metrics=("pearson", "spearman")),
        GlueTask("qqp", "QQP", ("question1", "question2"), ("not_duplicate", "duplicate"), 2, False, _STD,
                 ("question1", "question2", "is_duplicate"), metrics=("f1", "accuracy")),
        GlueTask("mnli", "MNLI", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), 3, False,
                 _MNLI, ("sentence1", "sentence2", "gold_label")),
        GlueTask("qnli", "QNLI", ("question", "sentence"), ("entailment", "not_entailment"), 2, False, _STD,
                 ("question", "sentence", "label")),
        GlueTask("rte", "RTE", ("sentence1", "sentence2"), ("entailment", "not_entailment"), 2, False, _STD,
                 ("sentence1", "sentence2", "label")),
    )
}

#: The eight tasks of the paper's GLUE8 (all of GLUE but WNLI), in the column order of its Table 2.
GLUE8_TASKS: Tuple[str, ...] = tuple(GLUE_TASKS)

#: The labelled GLUE validation sets by name -> (task, split).
GLUE_EVAL_SETS: Dict[str, Tuple[GlueTask, str]] = {
    t.eval_set_name(split): (t, split) for t in GLUE_TASKS.values() for split in t.eval_splits}

_TASK_ALIASES = {"sst-2": "sst2", "sts-b": "stsb"}


def glue_task(name: str) -> GlueTask:
    """The :class:`GlueTask` for ``name`` (case-insensitive; ``SST-2``/``STS-B`` spellings accepted)."""
    key = str(name).strip().lower()
    key = _TASK_ALIASES.get(key, key)
    if key not in GLUE_TASKS:
        raise KeyError(f"unknown GLUE task {name!r}; known tasks: {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[key]


def glue_eval_set(name: str) -> Tuple[GlueTask, str]:
    """``(task, split)`` of a GLUE validation set named as in :data:`GLUE_EVAL_SETS` (case-insensitive)."""
    key = str(name).strip().lower()
    key = _TASK_ALIASES.get(key, key)
    if key not in GLUE_EVAL_SETS:
        raise ValueError(f"unknown GLUE eval set {name!r}; valid names: {', '.join(GLUE_EVAL_SETS)}")
    return GLUE_EVAL_SETS[key]


# ------------------------------------------------------------------------------------------------------------- math


@dataclass(frozen=True)
class MathDataset:
    """One LLM-Adapters math test set: ``answer`` ``"number"`` (the last number of a generation) or ``"choice"`` (an
    AQuA option letter A-E); ``folder``: its folder in LLM-Adapters' ``dataset/`` tree."""

    name: str
    answer: str
    folder: str


MATH_DATASETS: Dict[str, MathDataset] = {
    d.name: d
    for d in (
        MathDataset("gsm8k", "number", "gsm8k"),
        MathDataset("aqua", "choice", "AQuA"),
        MathDataset("mawps", "number", "mawps"),
        MathDataset("svamp", "number", "SVAMP"),
        MathDataset("addsub", "number", "AddSub"),
        MathDataset("multiarith", "number", "MultiArith"),
        MathDataset("singleeq", "number", "SingleEq"),
    )
}

#: The paper's Math-10K test sets, in the column order of its tables.
MATH_SETS: Tuple[str, ...] = ("gsm8k", "aqua", "mawps", "svamp")

#: Groups of generation eval sets (``TrainConfig.eval_tasks``).
EVAL_GROUPS: Dict[str, Tuple[str, ...]] = {"glue8": GLUE8_TASKS, "math": MATH_SETS}


def expand_eval_tasks(names: Union[str, Sequence[str], None]) -> List[str]:
    """Validate eval-set names, expand the groups ``glue8`` / ``math``, drop duplicates (order kept)."""
    if names is None:
        return []
    if isinstance(names, str):
        names = [t for t in names.split(",")]
    out: List[str] = []
    for raw in names:
        key = str(raw).strip().lower().replace("-", "")
        if not key:
            continue
        if key in EVAL_GROUPS:
            items = EVAL_GROUPS[key]
        elif key in GLUE8_TASKS or key in MATH_SETS:
            items = (key,)
        else:
            valid = ", ".join((*EVAL_GROUPS, *GLUE8_TASKS, *MATH_SETS))
            raise ValueError(f"unknown eval set {raw!r}; valid: {valid}")
        out.extend(i for i in items if i not in out)
    return out


# ------------------------------------------------------------------------------------------------- training tasks

#: Task families: which defaults (``TrainConfig``) and which learning rates (a method's ``MethodSpec.lr``) apply.
FAMILIES = ("glue", "math", "demo")


@dataclass(frozen=True)
class Task:
    """A training task (``TrainConfig.task``): ``family`` (one of :data:`FAMILIES`), ``head`` ``"seq_cls"`` (a
    classifier with ``num_labels`` outputs) or ``"causal_lm"`` (trained on text, evaluated by generation), and the
    GLUE task it trains, if any."""

    name: str
    family: str
    head: str
    num_labels: Optional[int] = None
    glue: Optional[GlueTask] = None


TASKS: Dict[str, Task] = {
    t.name: t
    for t in (
        Task("synthetic", "demo", "seq_cls", 2),  # the built-in demo task (prismdp.data.synthetic)
        Task("instruct", "math", "causal_lm"),  # LLM-Adapters instruction data (Math-10K's rates)
        Task("glue8", "glue", "causal_lm"),  # the GLUE8 mixture as instructions (prismdp.data.glue8)
        *(Task(g.name, "glue", "seq_cls", g.num_labels, g) for g in GLUE_TASKS.values()),
    )
}


def train_task(name: str) -> Task:
    """The :class:`Task` called ``name``."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]
