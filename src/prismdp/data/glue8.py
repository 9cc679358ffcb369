"""GLUE8: the PRISM paper's multi-task GLUE training mixture, rebuilt from the GLUE train splits.

The paper (Appendix B, Table "Dataset splits") trains one adapter on **1,250 examples per task** of the eight GLUE
tasks other than WNLI (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE; 10,000 in all), written as LLM-Adapters
instruction records ``{"instruction", "input", "output"}``, and evaluates on the official validation splits.  The
authors' file (``ft-training_set/glue8_1250.json``) is not public; this module rebuilds an equivalent mixture.

Sampling (seeded, per task, independent of the other tasks)
    For each task: read the GLUE ``train`` split with :func:`prismdp.data.load_glue`, then keep the examples at
    ``sorted(random.Random(seed).sample(range(len(train)), per_task))`` -- the same rule as the trainer's
    ``train_examples`` subset, so an encoder run ``--task sst2 --train-examples 1250 --seed 42`` trains on exactly
    the SST-2 part of the seed-42 mixture.  A task with fewer than ``per_task`` train examples is taken whole.
    The mixture lists the tasks in :data:`GLUE8_TASKS` order, each in its original row order (the trainer draws
    Poisson batches, so the order does not matter).  With ``/work/shared/data/glue``, MNLI, QNLI and QQP come from
    9,999-example subsets of their GLUE train splits (the full splits are not available offline; ``load_glue``
    warns); a rebuilt file cannot have the authors' sha256.  All 10,000 records are training data here (the
    reference trainer may hold some out for a validation loss; evaluation is on the GLUE validation splits anyway).

Instruction format (the PRISM reference code's ``glue_to_instruction_input``)
    A fixed instruction per task that names the task and its label words (:data:`INSTRUCTIONS`); the input lists
    the sentence(s) with field names (``"Sentence: ..."``, ``"Premise: ...\\nHypothesis: ..."``); the output is the
    label word of the Hugging Face ``glue`` label id (``GlueTask.label_names`` of :mod:`prismdp.data.tasks`, e.g.
    ``not_equivalent``) or, for STS-B, the similarity score with one decimal (``"3.8"``).  Predictions are read
    back with :func:`prismdp.eval.answers.parse_glue_label`.

For encoders, :func:`glue8_examples` returns the same per-task samples as plain :class:`Example` lists (one head
per task; labels are the GLUE ids / STS-B floats).

Command line (writes the mixture as an LLM-Adapters JSON array)::

    python -m prismdp.data.glue8 --data /work/shared/data/glue --out glue8_1250.json [--per-task 1250] [--seed 42]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Union

from ..atomic import write_json
from .example import Example
from .splits import seeded_subset
from .glue import load_glue
from .tasks import GLUE8_TASKS, glue_task

__all__ = [
    "GLUE8_TASKS",
    "PER_TASK",
    "INSTRUCTIONS",
    "INPUT_FIELDS",
    "Glue8Item",
    "format_input",
    "format_output",
    "to_instruct_record",
    "build_glue8",
    "glue8_examples",
    "glue8_records",
    "write_glue8_json",
]

#: Training examples per task in the paper.
PER_TASK = 1250

#: One fixed instruction per task (verbatim from the PRISM reference code); each names its label words.
INSTRUCTIONS: Dict[str, str] = {
    "cola": "Task: CoLA (linguistic acceptability). Determine whether the sentence is grammatically acceptable. "
            "Answer with exactly one label: acceptable, unacceptable.",
    "sst2": "Task: SST-2 (sentiment). Determine the sentiment of the sentence. "
            "Answer with exactly one label: positive, negative.",
    "mrpc": "Task: MRPC (paraphrase). Determine whether the two sentences are semantically equivalent. "
            "Answer with exactly one label: equivalent, not_equivalent.",
    "stsb": "Task: STS-B (semantic textual similarity). Rate the semantic similarity of the two sentences on a scale "
            "from 0 to 5 (0 = completely different, 5 = equivalent in meaning). Answer with a single number (you may "
            "use one decimal place).",
    "qqp": "Task: QQP (duplicate questions). Determine whether the two questions are duplicates. "
           "Answer with exactly one label: duplicate, not_duplicate.",
    "mnli": "Task: MNLI (natural language inference). Given a premise and a hypothesis, determine the relationship. "
            "Answer with exactly one label: entailment, neutral, contradiction.",
    "qnli": "Task: QNLI (question-answering NLI). Given a question and a sentence, determine whether the sentence "
            "entails the answer to the question. Answer with exactly one label: entailment, not_entailment.",
    "rte": "Task: RTE (recognizing textual entailment). Given a premise and a hypothesis, determine whether the "
           "premise entails the hypothesis. Answer with exactly one label: entailment, not_entailment.",
}

#: Field names written before text_a (and text_b) in the input.
INPUT_FIELDS: Dict[str, tuple] = {
    "cola": ("Sentence",),
    "sst2": ("Sentence",),
    "mrpc": ("Sentence 1", "Sentence 2"),
    "stsb": ("Sentence 1", "Sentence 2"),
    "qqp": ("Question 1", "Question 2"),
    "mnli": ("Premise", "Hypothesis"),
    "qnli": ("Question", "Sentence"),
    "rte": ("Premise", "Hypothesis"),
}


class Glue8Item(NamedTuple):
    """One example of the mixture: its task and the GLUE example (HF label id, STS-B float)."""

    task: str
    example: Example


def _task_name(task: str) -> str:
    name = glue_task(task).name
    if name not in GLUE8_TASKS:  # pragma: no cover - GLUE_TASKS == GLUE8_TASKS today
        raise ValueError(f"{task!r} is not a GLUE8 task ({', '.join(GLUE8_TASKS)})")
    return name


def format_input(task: str, example: Example) -> str:
    """The instruction record's ``input``: ``"Sentence: ..."`` or ``"<field 1>: ...\\n<field 2>: ..."``."""
    fields = INPUT_FIELDS[_task_name(task)]
    if len(fields) == 1:
        return f"{fields[0]}: {example.text_a}"
    return f"{fields[0]}: {example.text_a}\n{fields[1]}: {example.text_b or ''}"


def format_output(task: str, label: Union[int, float]) -> str:
    """The target text: the label word of a class id, or the STS-B score with one decimal (``"3.8"``)."""
    name = _task_name(task)
    if name == "stsb":
        value = float(label)
        if not 0.0 <= value <= 5.0:
            raise ValueError(f"STS-B score {label!r} outside [0, 5]")
        return f"{value:.1f}"
    words = glue_task(name).label_names
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(words):
        raise ValueError(f"{name} label {label!r} is not a class id 0..{len(words) - 1}")
    return words[label]


def to_instruct_record(task: str, example: Example) -> Dict[str, str]:
    """LLM-Adapters record ``{"instruction", "input", "output"}`` of one GLUE example."""
    name = _task_name(task)
    return {"instruction": INSTRUCTIONS[name], "input": format_input(name, example),
            "output": format_output(name, example.label)}


def _tasks(tasks: Optional[Sequence[str]]) -> List[str]:
    names = [_task_name(t) for t in (tasks if tasks is not None else GLUE8_TASKS)]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tasks in {list(tasks or ())}")
    if not names:
        raise ValueError("no GLUE8 tasks selected")
    return names


def glue8_examples(data_dir: Union[str, os.PathLike, None], per_task: Optional[int] = PER_TASK, seed: int = 42,
                   tasks: Optional[Sequence[str]] = None) -> Dict[str, List[Example]]:
    """Per-task seeded training samples (plain :class:`Example` lists, for encoders); see the module doc.

    ``data_dir`` is the GLUE root for :func:`load_glue` (``None`` = the Hugging Face Hub).
    """
    return {name: seeded_subset(load_glue(name, "train", data_dir), per_task, seed) for name in _tasks(tasks)}


def build_glue8(data_dir: Union[str, os.PathLike, None], per_task: Optional[int] = PER_TASK, seed: int = 42,
                tasks: Optional[Sequence[str]] = None) -> List[Glue8Item]:
    """The mixture as (task, example) items, tasks in :data:`GLUE8_TASKS` order (or the order of ``tasks``)."""
    return [Glue8Item(name, ex) for name, exs in glue8_examples(data_dir, per_task, seed, tasks).items() for ex in exs]


def glue8_records(items: Sequence[Glue8Item]) -> List[Dict[str, str]]:
    """LLM-Adapters records of the mixture (for causal LMs)."""
    return [to_instruct_record(it.task, it.example) for it in items]


def write_glue8_json(path: Union[str, os.PathLike], items: Sequence[Glue8Item]) -> Path:
    """Write the mixture as a JSON array of LLM-Adapters records (indent 4, like LLM-Adapters' files)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_json(p, glue8_records(items), indent=4, sort_keys=False, ensure_ascii=False)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prismdp.data.glue8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="GLUE root folder (task folders CoLA/, SST-2/, ...)")
    ap.add_argument("--out", required=True, help="output JSON file")
    ap.add_argument("--per-task", type=int, default=PER_TASK)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--tasks", default=",".join(GLUE8_TASKS), help="comma-separated subset of the eight tasks")
    args = ap.parse_args(argv)
    items = build_glue8(args.data, args.per_task, args.seed, [t for t in args.tasks.split(",") if t.strip()])
    write_glue8_json(args.out, items)
    counts: Dict[str, int] = {}
    for it in items:
        counts[it.task] = counts.get(it.task, 0) + 1
    print(f"wrote {len(items)} records to {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
