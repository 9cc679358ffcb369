"""Answer extraction from generated text: Math-10K (LLM-Adapters protocol) and GLUE label words.

Math-10K (the paper: "exact answer accuracy using the LLM-Adapters protocol")
----------------------------------------------------------------------------
Numeric datasets (gsm8k, mawps, svamp; also LLM-Adapters' addsub, multiarith, singleeq), as in
LLM-Adapters ``evaluate.py::extract_answer_number``: delete every comma (so ``1,234`` -> ``1234``), take the
LAST match of ``-?\\d+\\.?\\d*``, and count it correct iff ``abs(pred - float(gold)) <= 0.001``.  Quirks kept
on purpose because they are part of the protocol: a hyphen directly before a digit is a minus sign
(``"10-3"`` ends in ``-3``), ``".5"`` reads as ``5``, ``"1e5"`` reads as ``5``, and commas inside a list
of numbers glue them together (``"3,4"`` -> ``34``).  No number -> ``None`` (LLM-Adapters uses ``inf``,
i.e. always wrong; here it is additionally counted as *unparsed*).

AQuA (multiple choice A-E).  Three rules exist in the wild; ``extract_choice(text, rule=...)``:

* ``"first"`` (default, :data:`DEFAULT_AQUA_RULE`, everywhere in prismdp): upstream AGI-Edgerunners/LLM-Adapters
  ``evaluate.py::extract_answer_letter`` verbatim -- ``re.findall(r'A|B|C|D|E', text.strip())[0]``, i.e. the FIRST
  capital A-E (so ``"Answer: (C)"`` gives ``"A"``): the protocol the paper names.
* ``"last"``: the LAST capital letter A-E anywhere in the text, case-sensitive (``re.findall('[A-E]')[-1]``).  On
  the archived model outputs in ``aqua_test.json`` it disagrees with ``"first"`` on 48 of 254.
* ``"prism"``: the evaluator shipped with the PRISM code (``LLM-Adapters/evaluate.py`` of the
  ZsyRock/PRISM-DP-LoRA fork, ``_extract_answer_letter``): upper-case the text, take the last A-E that is not
  adjacent to another letter A-Z, else fall back to the last A-E anywhere.  It agrees with ``"last"`` on 253 of
  the 254 archived outputs; it differs when the text has no standalone letter, because its fallback reads
  letters out of ordinary lower-case words (``"... be x."`` -> ``"E"``).

The gold AQuA answer is compared after ``strip().upper()``.

GLUE label words (causal-LM generations for the GLUE8 prompts)
-------------------------------------------------------------
:func:`parse_glue_label` maps a generation to the integer label ids of the Hugging Face ``glue`` datasets
(the task's ``GlueTask.label_names`` in :mod:`prismdp.data.tasks`); STS-B gives a float clipped to [0, 5].
Matching is case-insensitive, on whole words (a label must not be preceded or followed by a letter, digit or ``_``),
and the negated labels are tried before their positive substrings, so ``not_entailment`` / ``not entailment`` /
``not-entailment`` never read as ``entailment`` and ``unacceptable`` / ``not acceptable`` never read as
``acceptable``.  The FIRST label occurrence in the text wins (generations are short label answers that may continue
with unrelated text).  A negated form that is not itself a label (e.g. ``not positive``, ``not neutral``) is ignored,
as are ``yes``/``no``.  STS-B: the FIRST number in the text (commas deleted, as in the authors' ``parse_pred``),
clipped to [0, 5].  Unparseable -> ``None``.  (The authors' ``parse_pred`` instead falls back to label 0 / 0.0 for
unparseable text; that choice is left to the caller.)
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional, Sequence, Union

from ..data.tasks import GLUE_EVAL_SETS, GLUE_TASKS, MATH_DATASETS, GlueTask, glue_eval_set, glue_task

__all__ = [
    "NUMERIC_DATASETS",
    "CHOICE_DATASETS",
    "MATH_TOLERANCE",
    "AQUA_RULES",
    "DEFAULT_AQUA_RULE",
    "extract_number",
    "extract_choice",
    "extract_answer",
    "is_correct",
    "math_accuracy",
    "parse_glue_label",
    "parse_glue_labels",
]

NUMERIC_DATASETS = frozenset(d.name for d in MATH_DATASETS.values() if d.answer == "number")
CHOICE_DATASETS = frozenset(d.name for d in MATH_DATASETS.values() if d.answer == "choice")
MATH_TOLERANCE = 1e-3  # LLM-Adapters: abs(label - predict) <= 0.001
AQUA_RULES = ("first", "last", "prism")
DEFAULT_AQUA_RULE = "first"  # upstream LLM-Adapters evaluate.py

_NUMBER_RE = re.compile(r"-?\d+\.?\d*")  # LLM-Adapters extract_answer_number
_LETTER_RE = re.compile(r"[A-E]")
_STANDALONE_LETTER_RE = re.compile(r"(?:^|[^A-Z])([A-E])(?:$|[^A-Z])")


# --------------------------------------------------------------------------------------------------------
# Math-10K
# --------------------------------------------------------------------------------------------------------
def extract_number(text: Optional[str]) -> Optional[float]:
    """Last number in ``text`` after deleting commas (LLM-Adapters rule); ``None`` if there is none."""
    if text is None:
        return None
    matches = _NUMBER_RE.findall(str(text).replace(",", ""))
    if not matches:
        return None
    value = float(matches[-1])
    return value if math.isfinite(value) else None


def extract_choice(text: Optional[str], rule: str = DEFAULT_AQUA_RULE) -> Optional[str]:
    """AQuA option letter ``"A"``-``"E"`` from ``text`` (see module doc for ``rule``); ``None`` if none."""
    if rule not in AQUA_RULES:
        raise ValueError(f"unknown AQuA rule {rule!r}; valid: {', '.join(AQUA_RULES)}")
    if text is None:
        return None
    s = str(text)
    if rule == "last":
        found = _LETTER_RE.findall(s)
        return found[-1] if found else None
    if rule == "first":
        found = _LETTER_RE.findall(s.strip())
        return found[0] if found else None
    up = s.upper()
    found = _STANDALONE_LETTER_RE.findall(up)
    if found:
        return found[-1]
    found = _LETTER_RE.findall(up)
    return found[-1] if found else None


def _dataset_key(dataset: str) -> str:
    key = str(dataset).strip().lower()
    if key not in NUMERIC_DATASETS and key not in CHOICE_DATASETS:
        valid = ", ".join(sorted(NUMERIC_DATASETS | CHOICE_DATASETS))
        raise ValueError(f"unknown math dataset {dataset!r}; valid names (case-insensitive): {valid}")
    return key


def _gold_number(gold: Any) -> float:
    try:
        value = float(str(gold).replace(",", "").strip())
    except ValueError:
        raise ValueError(f"gold answer {gold!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"gold answer {gold!r} is not finite")
    return value


def _gold_choice(gold: Any) -> str:
    g = str(gold).strip().upper()
    if g not in ("A", "B", "C", "D", "E"):
        raise ValueError(f"gold AQuA answer {gold!r} is not one of A-E")
    return g


def extract_answer(dataset: str, generation: Optional[str], aqua_rule: str = DEFAULT_AQUA_RULE
                   ) -> Optional[Union[float, str]]:
    """The answer the LLM-Adapters protocol reads from ``generation``: the last number (AQuA: an option letter by
    ``aqua_rule``), or None when there is none."""
    if _dataset_key(dataset) in CHOICE_DATASETS:
        return extract_choice(generation, rule=aqua_rule)
    return extract_number(generation)


def _judge(key: str, generation: Optional[str], gold: Any, aqua_rule: str) -> tuple[bool, bool]:
    """(correct, parsed)."""
    pred = extract_answer(key, generation, aqua_rule)
    if pred is None:
        return False, False
    if key in CHOICE_DATASETS:
        return pred == _gold_choice(gold), True
    return abs(pred - _gold_number(gold)) <= MATH_TOLERANCE, True


def is_correct(dataset: str, generation: Optional[str], gold: Any, aqua_rule: str = DEFAULT_AQUA_RULE) -> bool:
    """Whether ``generation`` answers ``gold`` under the LLM-Adapters protocol (unparseable -> False).

    ``dataset`` is case-insensitive (``"AQuA"``, ``"SVAMP"`` ...); an unknown name or a malformed gold raises
    ``ValueError``.
    """
    return _judge(_dataset_key(dataset), generation, gold, aqua_rule)[0]


def math_accuracy(
    dataset: str,
    generations: Sequence[Optional[str]],
    golds: Sequence[Any],
    aqua_rule: str = DEFAULT_AQUA_RULE,
) -> dict[str, Union[float, int]]:
    """``{"accuracy", "n", "correct", "unparsed"}`` over a test set.

    Unparseable generations (no number / no letter) count as wrong and are counted in ``unparsed``.
    Empty inputs or a length mismatch raise ``ValueError``.
    """
    key = _dataset_key(dataset)
    gens = list(generations)
    gs = list(golds)
    if not gens or not gs:
        raise ValueError("empty input: generations and golds must be non-empty")
    if len(gens) != len(gs):
        raise ValueError(f"length mismatch: {len(gens)} generations vs {len(gs)} golds")
    correct = unparsed = 0
    for gen, gold in zip(gens, gs):
        ok, parsed = _judge(key, gen, gold, aqua_rule)
        correct += int(ok)
        unparsed += int(not parsed)
    n = len(gens)
    return {"accuracy": correct / n, "n": n, "correct": correct, "unparsed": unparsed}


# --------------------------------------------------------------------------------------------------------
# GLUE label words
# --------------------------------------------------------------------------------------------------------
_IGNORE = object()  # matched text that must not be read as any label ("not positive", "not neutral")
_NOT = r"not[\s_\-]*"
_BOUNDARY_L = r"(?<![a-z0-9_])"
_BOUNDARY_R = r"(?![a-z0-9_])"
_STSB_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


def _build_label_pattern(labels: tuple[str, ...]) -> tuple[re.Pattern[str], list[Any]]:
    alternatives: list[tuple[str, Any]] = []
    bases = set()
    for idx, word in enumerate(labels):
        if word.startswith("not_"):
            alternatives.append((_NOT + re.escape(word[4:]), idx))
            bases.add(word[4:])
        elif word == "unacceptable":
            alternatives.append((r"un[\-]?acceptable", idx))
            alternatives.append((_NOT + "acceptable", idx))
            bases.add("acceptable")
    for idx, word in enumerate(labels):
        if word.startswith("not_") or word == "unacceptable":
            continue
        if word not in bases:  # negation of a label that has no negated label: ignore it
            alternatives.append((_NOT + re.escape(word), _IGNORE))
        alternatives.append((re.escape(word), idx))
    # longer alternatives first so a regex alternation never stops at a shorter label inside a longer one
    alternatives.sort(key=lambda a: -len(a[0]))
    pattern = _BOUNDARY_L + "(?:" + "|".join(f"({a})" for a, _ in alternatives) + ")" + _BOUNDARY_R
    return re.compile(pattern), [v for _, v in alternatives]


_LABEL_PATTERNS = {t.name: _build_label_pattern(t.label_names) for t in GLUE_TASKS.values() if t.label_names}


def _label_task(task: str) -> GlueTask:
    """A GLUE task named by itself or by one of its eval sets (``mnli_matched``)."""
    try:
        return glue_task(task)
    except KeyError:
        pass
    try:
        return glue_eval_set(task)[0]
    except ValueError:
        valid = ", ".join(dict.fromkeys((*GLUE_TASKS, *GLUE_EVAL_SETS)))
        raise ValueError(f"unknown GLUE task {task!r}; valid names: {valid}") from None


def parse_glue_label(task: str, text: Optional[str]) -> Optional[Union[int, float]]:
    """Label id (int; float in [0, 5] for stsb) named in a generation, or ``None`` if unparseable.

    ``task``: cola, sst2, mrpc, stsb, qqp, mnli (or mnli_matched / mnli_mismatched), qnli, rte.
    """
    glue = _label_task(task)
    if text is None:
        return None
    s = str(text).lower()
    if glue.is_regression:
        m = _STSB_NUMBER_RE.search(s.replace(",", ""))
        if m is None:
            return None
        value = float(m.group(0))
        if not math.isfinite(value):
            return None
        return min(5.0, max(0.0, value))
    pattern, values = _LABEL_PATTERNS[glue.name]
    for m in pattern.finditer(s):
        value = values[m.lastindex - 1]
        if value is not _IGNORE:
            return value
    return None


def parse_glue_labels(task: str, texts: Iterable[Optional[str]]) -> list[Optional[Union[int, float]]]:
    """:func:`parse_glue_label` over a sequence."""
    return [parse_glue_label(task, t) for t in texts]

