"""Generation-based evaluation of causal LMs: GLUE8 label words and the Math-10K test sets.

Decoding (both suites): the prompt is the LLM-Adapters training template with an empty output
(:func:`prismdp.data.generate_prompt`, i.e. ``generate_prompt`` of LLM-Adapters ``finetune.py`` / the PRISM code's
``build_prompt``), tokenised with the tokenizer's special tokens like the training examples; prompts are batched
(sorted by length, **left**-padded), decoded **greedily** (``do_sample=False``, one beam) with the KV cache,
``max_new_tokens`` new tokens at most, stopping at EOS.  Only the new tokens are decoded (special tokens skipped),
which equals LLM-Adapters' ``output.split("### Response:")[1]`` up to surrounding whitespace.  Prompts are never
truncated.

GLUE (official validation splits; MNLI matched and mismatched): the generation is mapped to a label by
:func:`prismdp.eval.answers.parse_glue_label` and scored with :func:`prismdp.eval.metrics.glue_metrics` /
:func:`~prismdp.eval.metrics.main_score`.  An unparseable generation is counted (``unparsed``) and, with the
default ``unparsed="wrong"``, scored as a certainly wrong prediction: the next class ``(gold + 1) % k`` (so it is
wrong for accuracy, F1 and MCC alike) and, for STS-B, the end of [0, 5] farther from the gold score.
``unparsed="fallback"`` reproduces the PRISM reference code instead (label 0 / score 0.0, which can be right by
chance).  Default ``max_new_tokens``: 8 (the reference code's).

Math (GSM8K, AQuA, MAWPS, SVAMP test files of LLM-Adapters): exact answer accuracy under the LLM-Adapters
protocol (:func:`prismdp.eval.answers.math_accuracy`: last number, tolerance 1e-3; AQuA by ``aqua_rule``, default
``"first"`` = upstream LLM-Adapters' first capital A-E); the gold answer is the record's ``answer`` (its ``output``
is an archived model response, not gold); unparseable generations count as wrong and are counted.  Default
``max_new_tokens``: 256 (LLM-Adapters' ``evaluate.py``).

Eval-set names (``TrainConfig.eval_tasks``): the GLUE tasks ``cola sst2 mrpc stsb qqp mnli qnli rte`` (``mnli``
= both validation sets), the math sets ``gsm8k aqua mawps svamp``, and the groups ``glue8`` and ``math``.
:func:`resolve_eval_sets` finds their files under an eval-data folder and reports the ones it cannot find
(e.g. QQP validation, absent from ``/work/shared/data``) instead of failing, unless none is found at all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..atomic import write_text
from .answers import AQUA_RULES, GLUE_LABELS, extract_answer, math_accuracy, parse_glue_label
from .metrics import GLUE8_COLUMNS, glue_metrics, main_score, mnli_score

__all__ = [
    "MATH_SETS",
    "GLUE_SETS",
    "EVAL_GROUPS",
    "DEFAULT_MAX_NEW_TOKENS",
    "UNPARSED_POLICIES",
    "EvalSet",
    "Generations",
    "expand_eval_tasks",
    "resolve_eval_sets",
    "generate",
    "evaluate_glue_generation",
    "evaluate_math_generation",
    "run_eval_sets",
    "table_scores",
    "MATH_COLUMNS",
]

GLUE_SETS = GLUE8_COLUMNS
MATH_SETS = ("gsm8k", "aqua", "mawps", "svamp")
MATH_COLUMNS = MATH_SETS
EVAL_GROUPS = {"glue8": GLUE_SETS, "math": MATH_SETS}
DEFAULT_MAX_NEW_TOKENS = {"glue": 8, "math": 256}
UNPARSED_POLICIES = ("wrong", "fallback")
# folder names of the test sets in LLM-Adapters' dataset/ tree
_UPSTREAM_DIRS = {"gsm8k": "gsm8k", "aqua": "AQuA", "mawps": "mawps", "svamp": "SVAMP"}


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
        elif key in GLUE_SETS or key in MATH_SETS:
            items = (key,)
        else:
            valid = ", ".join((*EVAL_GROUPS, *GLUE_SETS, *MATH_SETS))
            raise ValueError(f"unknown eval set {raw!r}; valid: {valid}")
        out.extend(i for i in items if i not in out)
    return out


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
        from ..data.instruct import generate_prompt

        return [generate_prompt({**r, "output": ""}) for r in self.records]


def _find_math_file(name: str, roots: Sequence[Path]) -> Optional[Path]:
    up = _UPSTREAM_DIRS[name]
    for root in roots:
        for cand in (root / f"{name}_test.json", root / "math" / f"{name}_test.json", root / up / "test.json",
                     root / name / "test.json", root / "dataset" / up / "test.json"):
            if cand.is_file():
                return cand
    return None


def _glue_roots(root: Path) -> List[Path]:
    return [root] + ([root / "glue"] if (root / "glue").is_dir() else [])


def _load_glue_split(task: str, split: str, roots: Sequence[Path]):
    from ..data.glue import load_glue

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
    from ..data.glue8 import to_instruct_record
    from ..data.instruct import load_instruct_json

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
                                 f"{_UPSTREAM_DIRS[name]}/test.json)" if root is not None else
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
        splits = ("validation_matched", "validation_mismatched") if name == "mnli" else ("validation",)
        for split in splits:
            set_name = name if split == "validation" else f"mnli_{split.split('_')[1]}"
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


class Generations(NamedTuple):
    texts: List[str]  # decoded new tokens, in the order of the prompts
    finished: List[bool]  # True if the generation ended with EOS (False: cut at max_new_tokens)
    prompt_tokens: List[int]


def _eos_ids(model, tokenizer) -> List[int]:
    ids = []
    gen = getattr(model, "generation_config", None)
    cand = getattr(gen, "eos_token_id", None)
    for v in ([tokenizer.eos_token_id] + (list(cand) if isinstance(cand, (list, tuple)) else [cand])):
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    return ids


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], *, batch_size: int = 16, max_new_tokens: int = 8,
             progress: bool = False, desc: str = "generate") -> Generations:
    """Batched greedy decoding with the KV cache and left padding (see the module doc)."""
    from transformers import GenerationConfig

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be >= 1")
    prompts = list(prompts)
    if not prompts:
        return Generations([], [], [])
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("the tokenizer has no pad token (load_model sets one)")
    eos = _eos_ids(model, tokenizer)
    if not eos:
        raise ValueError("the tokenizer has no eos token; generation could not stop")
    enc = [list(x) for x in tokenizer(prompts, add_special_tokens=True)["input_ids"]]
    order = sorted(range(len(prompts)), key=lambda i: -len(enc[i]))  # longest first: memory peaks early
    gen_cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens), use_cache=True,
                               pad_token_id=pad, eos_token_id=eos if len(eos) > 1 else eos[0])
    try:
        device = next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        device = torch.device("cpu")
    texts: List[Optional[str]] = [None] * len(prompts)
    finished: List[bool] = [False] * len(prompts)
    was_training = model.training
    model.eval()
    from tqdm.auto import tqdm

    bar = tqdm(total=len(prompts), desc=desc, unit="ex", disable=not progress, dynamic_ncols=True)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = max(len(enc[i]) for i in idx)
            ids = torch.full((len(idx), width), int(pad), dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, width - len(enc[i]):] = torch.tensor(enc[i], dtype=torch.long)
                mask[row, width - len(enc[i]):] = 1
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg)
            new = out[:, width:].cpu()
            for row, i in enumerate(idx):
                toks = new[row].tolist()
                stop = next((k for k, t in enumerate(toks) if t in eos), None)
                finished[i] = stop is not None
                texts[i] = tokenizer.decode(toks[:stop] if stop is not None else toks, skip_special_tokens=True)
            bar.update(len(idx))
    finally:
        bar.close()
        model.train(was_training)
    return Generations([t or "" for t in texts], finished, [len(e) for e in enc])


def _wrong_label(task: str, gold):
    if task == "stsb":
        return 0.0 if float(gold) >= 2.5 else 5.0
    k = len(GLUE_LABELS[task])
    return (int(gold) + 1) % k


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
    metric_task = metric_task or ("mnli_matched" if task == "mnli" else task)
    parsed = [parse_glue_label(task, g) for g in gens]
    if task == "stsb":
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
                             aqua_rule: str = "first") -> Dict[str, Any]:
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


def run_eval_sets(model, tokenizer, sets: Sequence[EvalSet], *, batch_size: int = 16,
                  max_new_tokens: Optional[int] = None, aqua_rule: str = "first", unparsed: str = "wrong",
                  progress: bool = False, generations_dir: Union[str, os.PathLike, None] = None
                  ) -> Dict[str, Dict[str, Any]]:
    """Generate and score every set; returns ``{set name: metrics}``.

    Each entry also records ``max_new_tokens``, ``unfinished`` (generations cut at ``max_new_tokens``), ``total``
    (size of the full set) and ``source``.  With ``generations_dir``, ``<set>.jsonl`` there holds one line per
    example: ``gold``, ``generation``, ``pred``.
    """
    out: Dict[str, Dict[str, Any]] = {}
    gdir = Path(generations_dir) if generations_dir is not None else None
    if gdir is not None:
        gdir.mkdir(parents=True, exist_ok=True)
    for s in sets:
        mnt = int(max_new_tokens) if max_new_tokens else DEFAULT_MAX_NEW_TOKENS[s.kind]
        g = generate(model, tokenizer, s.prompts(), batch_size=batch_size, max_new_tokens=mnt, progress=progress,
                     desc=f"eval {s.name}")
        if s.kind == "glue":
            metric_task = s.name if s.name.startswith("mnli_") else s.task
            res = evaluate_glue_generation(s.task, g.texts, s.golds, unparsed=unparsed, metric_task=metric_task)
            preds = res.pop("predictions")
        else:
            res = evaluate_math_generation(s.task, g.texts, s.golds, aqua_rule=aqua_rule)
            preds = res.pop("predictions")
        res.update(max_new_tokens=mnt, unfinished=sum(not f for f in g.finished), total=s.total or len(s.golds),
                   source=s.source, decoding="greedy")
        out[s.name] = res
        if gdir is not None:
            write_text(gdir / f"{s.name}.jsonl", "".join(
                json.dumps({"gold": gold, "generation": text, "pred": pred}, ensure_ascii=False) + "\n"
                for gold, text, pred in zip(s.golds, g.texts, preds)))
    return out


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
    for name, ev in evals.items():
        if not isinstance(ev, dict) or ev.get("score", ev.get("accuracy")) is None:
            continue
        if name in GLUE_SETS or name in MATH_SETS:
            cols[name] = float(ev["score"])
        elif name == "test" and task == "synthetic":
            cols["synthetic"] = float(ev["accuracy"])
        elif name in ("validation", "test") and task is not None:
            cols[task] = float(ev.get("score", ev.get("accuracy")))
    pairs = (("mnli_matched", "mnli_mismatched"), ("validation_matched", "validation_mismatched"))
    for a, b in pairs:
        if a in evals and b in evals:
            cols["mnli"] = mnli_score(evals[a], evals[b])
        elif a in evals and a == "validation_matched" and isinstance(evals[a], dict):
            cols["mnli"] = float(evals[a].get("accuracy", evals[a].get("score")))
    return cols
