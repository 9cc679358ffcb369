"""Generation-based evaluation of causal LMs (GLUE8 label words and the Math-10K test sets): every eval set
(:mod:`.sets`) is decoded (:mod:`.decoding`) and scored (:mod:`.scoring`), and the generations are kept.

Default ``max_new_tokens``: 8 for GLUE (the PRISM reference code's), 256 for math (LLM-Adapters' ``evaluate.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

from ..atomic import write_text
from .answers import DEFAULT_AQUA_RULE
from .decoding import generate
from .scoring import evaluate_glue_generation, evaluate_math_generation
from .sets import EvalSet

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "run_eval_sets"]

DEFAULT_MAX_NEW_TOKENS = {"glue": 8, "math": 256}


def run_eval_sets(model, tokenizer, sets: Sequence[EvalSet], *, batch_size: int = 16,
                  max_new_tokens: Optional[int] = None, aqua_rule: str = DEFAULT_AQUA_RULE, unparsed: str = "wrong",
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
            res = evaluate_glue_generation(s.task, g.texts, s.golds, unparsed=unparsed, metric_task=s.name)
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
