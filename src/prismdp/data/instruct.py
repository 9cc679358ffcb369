"""LLM-Adapters instruction data: JSON records, their prompt template, and tokenisation for causal-LM training.

Records are the LLM-Adapters ``{"instruction", "input", "output"}`` objects (``answer`` optional: the gold answer of
the math sets, unused by training).  :func:`load_instruct_json` reads a JSON array (or JSON Lines, one object per
line, for ``*.jsonl``) and validates it.

Prompt template
---------------
:func:`generate_prompt` reproduces ``generate_prompt`` of AGI-Edgerunners/LLM-Adapters ``finetune.py`` (current
version, commit 91770ab; identical to ``generate_prompt`` in osu-srml/PRISM-DP-LoRA ``src/prism_cli/utils.py``, the
code behind the paper) character for character, including its "formatting disaster": 16 spaces of source
indentation at the start of every line after the first, lines holding only those 16 spaces, one trailing space
after the first sentence block with input, two without input, no trailing newline.  An earlier LLM-Adapters revision
(063e3d4) had ``  # noqa: E501`` *inside* the string; we follow the later one, as the PRISM code does.  The
"with input" form is used when ``input`` is a non-empty string.

Tokenisation (:func:`tokenize_instruct`) follows LLM-Adapters ``generate_and_tokenize_prompt``:

* ``tokenizer(full_prompt, truncation=True, max_length=cutoff)`` with the tokenizer's own special tokens;
* EOS appended iff the last token is not already EOS **and** the sequence is shorter than ``max_length``
  (so a sequence cut at ``max_length`` carries no EOS);
* ``labels`` = ``input_ids``; with ``train_on_inputs=False`` the first ``prompt_len`` labels are ``-100``.

``prompt_len`` (``prompt_mask``):

* ``"exact"`` (default, needs a fast tokenizer's offset mapping): the number of leading tokens of the full
  sequence that lie entirely inside the prompt text (prompt = the template with ``output=""``); a token straddling
  the prompt/output boundary counts as output.  The labels are then ``-100`` exactly on the prompt part.
* ``"llm_adapters"``: LLM-Adapters' rule, the length of a *separate* tokenisation of the prompt (truncated at
  ``max_length``, no EOS).  The prompt ends with 16 spaces that BPE tokenisers merge differently with and without
  the output after them; with the SmolLM2 tokenizer on math_10k the two rules agree on 9,203 of 9,919 records and
  in the others LLM-Adapters leaves one whitespace token of the prompt unmasked.  Tokenizers without offsets fall
  back to this rule.

``truncated`` is True when the untruncated sequence (prompt + output + the EOS LLM-Adapters would append) does
not fit in ``max_length``: output tokens or the EOS were cut.

Fully masked examples: with ``train_on_inputs=False`` and a prompt of ``>= max_length`` tokens every label is
``-100``, the example has no target tokens (a per-example token-mean loss would be 0/0).  :func:`build_instruct_dataset`
**raises** by default (``fully_masked="error"``), naming how many, which and the fix; ``fully_masked="keep"`` keeps
them (their loss must be defined as 0 by the training loop) and reports their number.  Nothing is ever dropped,
so the dataset size (which enters the DP sampling rate) is the number of records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, NamedTuple, Sequence, Union

from .files import read_text

__all__ = [
    "InstructDataError",
    "InstructDataset",
    "IGNORE_INDEX",
    "load_instruct_json",
    "generate_prompt",
    "tokenize_instruct",
    "build_instruct_dataset",
]

#: label value ignored by the causal-LM loss (PyTorch CrossEntropyLoss default ignore_index).
IGNORE_INDEX = -100

_REQUIRED = ("instruction", "input", "output")
_BATCH = 512  # records per tokenizer call in build_instruct_dataset
_INDENT = " " * 16  # the indentation of the template in LLM-Adapters' finetune.py, which ends up in the prompt


class InstructDataError(ValueError):
    """Instruction data that cannot be used (bad JSON, missing keys, empty, fully masked examples)."""


class InstructDataset(NamedTuple):
    """Result of :func:`build_instruct_dataset`."""

    examples: List[Dict[str, Any]]
    n_truncated: int
    n_fully_masked: int


def _validate_record(rec: Any, where: str, keep: Sequence[str] = ()) -> Dict[str, Any]:
    if not isinstance(rec, dict):
        raise InstructDataError(f"{where}: expected an object with keys {list(_REQUIRED)}, got {type(rec).__name__}")
    missing = [k for k in _REQUIRED if k not in rec]
    if missing:
        raise InstructDataError(
            f"{where}: missing key(s) {missing} (found {sorted(rec)}); LLM-Adapters records need "
            f"instruction, input (may be \"\") and output")
    for k in _REQUIRED:
        if not isinstance(rec[k], str):
            raise InstructDataError(f"{where}: {k!r} must be a string, got {type(rec[k]).__name__}")
    if "answer" in rec and not isinstance(rec["answer"], (str, int, float)):
        raise InstructDataError(f"{where}: 'answer' must be a string or a number, got {type(rec['answer']).__name__}")
    out = {k: rec[k] for k in _REQUIRED}
    if "answer" in rec:
        out["answer"] = rec["answer"]
    for k in keep:
        if not isinstance(rec.get(k), (str, int)) or isinstance(rec.get(k), bool):
            raise InstructDataError(f"{where}: {k!r} must be present as a string or an integer (it names the "
                                    f"record's user), got {rec.get(k)!r}")
        out[k] = rec[k]
    return out


def load_instruct_json(path: Union[str, os.PathLike], keep: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """Read LLM-Adapters records from a JSON array file (or ``.jsonl``); validate every record.

    Returns dicts with keys ``instruction``, ``input``, ``output`` (and ``answer`` when present, and the ``keep``
    keys, which every record must have: e.g. a user id column).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"instruction data {p} not found (expected a JSON array of LLM-Adapters records "
                                f"{{\"instruction\", \"input\", \"output\"}})")
    text = read_text(p, "the instruction data (a JSON array of records)", InstructDataError)
    if not text.strip():
        raise InstructDataError(f"{p}: empty file (expected a JSON array of instruction/input/output records)")
    if p.suffix.lower() == ".jsonl":
        data = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    data.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InstructDataError(f"{p}:{i}: invalid JSON line ({e})") from e
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InstructDataError(f"{p}: invalid JSON ({e}); expected a JSON array of records "
                                    f"(use a .jsonl suffix for one record per line)") from e
    if not isinstance(data, list):
        raise InstructDataError(f"{p}: expected a JSON array of records, got a {type(data).__name__}")
    if not data:
        raise InstructDataError(f"{p}: no records (empty JSON array)")
    return [_validate_record(rec, f"{p} record {i}", keep) for i, rec in enumerate(data)]


def generate_prompt(record: Mapping[str, Any]) -> str:
    """LLM-Adapters' prompt for ``record`` (its ``output`` included; pass ``output=""`` for the bare prompt)."""
    instruction, inp, output = record["instruction"], record["input"], record["output"]
    if inp:
        return (
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request. \n"
            "\n"
            f"{_INDENT}### Instruction:\n"
            f"{_INDENT}{instruction}\n"
            f"{_INDENT}\n"
            f"{_INDENT}### Input:\n"
            f"{_INDENT}{inp}\n"
            f"{_INDENT}\n"
            f"{_INDENT}### Response:\n"
            f"{_INDENT}{output}"
        )
    return (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.  \n"
        "\n"
        f"{_INDENT}### Instruction:\n"
        f"{_INDENT}{instruction}\n"
        f"{_INDENT}\n"
        f"{_INDENT}### Response:\n"
        f"{_INDENT}{output}"
    )


def _encode(tokenizer, texts: List[str], with_offsets: bool):
    """Batch-encode ``texts`` (tokenizer's special tokens, no truncation) -> (ids lists, offsets lists or None).

    Offsets are None when not asked for or when the tokenizer cannot report them (slow Python tokenizers).
    """
    if with_offsets:
        try:
            enc = tokenizer(texts, add_special_tokens=True, return_offsets_mapping=True)
            offsets = enc.get("offset_mapping")
            if offsets is not None:
                return [list(x) for x in enc["input_ids"]], offsets
        except (NotImplementedError, TypeError, ValueError):
            pass
    enc = tokenizer(texts, add_special_tokens=True)
    return [list(x) for x in enc["input_ids"]], None


def _leading_tokens_within(offsets, n_chars: int) -> int:
    """Number of leading tokens whose character span ends within the first ``n_chars`` characters."""
    n = 0
    for _, end in offsets:
        if end > n_chars:
            break
        n += 1
    return n


def _check_args(tokenizer, max_length, prompt_mask) -> int:
    if int(max_length) < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if prompt_mask not in ("exact", "llm_adapters"):
        raise ValueError(f"prompt_mask must be 'exact' or 'llm_adapters', got {prompt_mask!r}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id; LLM-Adapters training appends EOS to every example")
    return int(max_length)


def _tokenize_many(records: Sequence[Mapping[str, Any]], tokenizer, max_length: int, train_on_inputs: bool,
                   prompt_mask: str) -> List[Dict[str, Any]]:
    max_length = _check_args(tokenizer, max_length, prompt_mask)
    eos = tokenizer.eos_token_id
    full_texts = [generate_prompt(r) for r in records]
    prompt_texts = [generate_prompt({**r, "output": ""}) for r in records]
    fulls, offsets = _encode(tokenizer, full_texts, with_offsets=prompt_mask == "exact")
    if offsets is None:  # LLM-Adapters' rule (or no offsets available): separate tokenisation of the prompt
        prompt_lens = [len(ids) for ids in _encode(tokenizer, prompt_texts, with_offsets=False)[0]]
    else:
        prompt_lens = [_leading_tokens_within(off, len(pt)) for off, pt in zip(offsets, prompt_texts)]

    # right truncation == slicing unless the tokenizer appends special tokens (e.g. [SEP]) at the end
    probe_bare = tokenizer("truncation probe", add_special_tokens=False)["input_ids"]
    probe = tokenizer("truncation probe", add_special_tokens=True)["input_ids"]
    slice_ok = list(probe[len(probe) - len(probe_bare):]) == list(probe_bare)
    out = []
    for text, full, prompt_len in zip(full_texts, fulls, prompt_lens):
        if not full:
            raise InstructDataError("the tokenizer returned no tokens for the prompt")
        truncated = len(full) + int(full[-1] != eos) > max_length
        if len(full) > max_length:
            if slice_ok:
                full = full[:max_length]
            else:  # the tokenizer's truncation keeps trailing special tokens, like LLM-Adapters' tokenizer call
                full = list(tokenizer(text, add_special_tokens=True, truncation=True,
                                      max_length=max_length)["input_ids"])
        input_ids = list(full)
        if input_ids[-1] != eos and len(input_ids) < max_length:
            input_ids.append(eos)
        labels = list(input_ids)
        prompt_len = min(prompt_len, max_length)
        if not train_on_inputs:
            n = min(prompt_len, len(labels))
            labels[:n] = [IGNORE_INDEX] * n
        out.append({
            "input_ids": input_ids,
            "attention_mask": [1] * len(input_ids),
            "labels": labels,
            "prompt_len": prompt_len,
            "truncated": truncated,
        })
    return out


def tokenize_instruct(record: Mapping[str, Any], tokenizer, max_length: int, train_on_inputs: bool,
                      *, prompt_mask: str = "exact") -> Dict[str, Any]:
    """Tokenise one record as LLM-Adapters does (see the module docstring).

    Returns ``{"input_ids", "attention_mask", "labels"}`` (lists of ints of equal length ``<= max_length``),
    ``"prompt_len"`` (tokens of the prompt without the output, the masked span when ``train_on_inputs`` is False)
    and ``"truncated"`` (bool).
    """
    return _tokenize_many([record], tokenizer, max_length, train_on_inputs, prompt_mask)[0]


def build_instruct_dataset(records: Sequence[Mapping[str, Any]], tokenizer, max_length: int, train_on_inputs: bool,
                           *, fully_masked: str = "error", prompt_mask: str = "exact") -> InstructDataset:
    """Tokenise every record; count truncations; handle examples without target tokens (see module docstring).

    ``fully_masked``: ``"error"`` (default) raises :class:`InstructDataError` if any example has all labels
    ``-100``; ``"keep"`` keeps them and reports how many in ``n_fully_masked``.  No example is ever dropped.
    """
    if fully_masked not in ("error", "keep"):
        raise ValueError(f"fully_masked must be 'error' or 'keep', got {fully_masked!r}")
    if len(records) == 0:
        raise InstructDataError("no instruction records to tokenise")
    examples: List[Dict[str, Any]] = []
    for start in range(0, len(records), _BATCH):
        examples.extend(_tokenize_many(records[start:start + _BATCH], tokenizer, max_length, train_on_inputs,
                                       prompt_mask))
    n_trunc = sum(int(ex["truncated"]) for ex in examples)
    masked_idx = [i for i, ex in enumerate(examples) if all(v == IGNORE_INDEX for v in ex["labels"])]
    if masked_idx and fully_masked == "error":
        raise InstructDataError(
            f"{len(masked_idx)} of {len(records)} examples have no target tokens left: their prompt alone fills "
            f"max_length={max_length} and train_on_inputs=False masks it (first indices: {masked_idx[:10]}). "
            f"Fix: raise max_length, set train_on_inputs=True, or pass fully_masked='keep' if the training loss "
            f"treats such examples as contributing zero.")
    return InstructDataset(examples, n_trunc, len(masked_idx))
