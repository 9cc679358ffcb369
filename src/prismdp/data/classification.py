"""Tokenise (text_a, text_b) examples for an encoder classifier, counting truncations.

Labels follow the model convention of :func:`prismdp.models.load_model`: ``num_labels == 1`` is a regression
(labels ``float32``), otherwise labels are class indices (``int64``) checked against ``range(num_labels)``.
Pairs are truncated by the tokenizer's ``longest_first`` strategy to ``max_length`` tokens (special tokens
included); an example counts as truncated when its untruncated encoding is longer than ``max_length``.  A tokenizer
that marks no boundary between the two sentences of a pair (a decoder's byte-level BPE, e.g. SmolLM2's, which would
run "...growth strategy ." into "The foodservice...") gets a newline before the second one (:data:`PAIR_SEPARATOR`);
encoders keep their own ``[SEP]`` / ``</s></s>`` and are encoded exactly as before.
Blank sentences (empty or whitespace only) are kept and counted, not refused: standard sets have a few (QQP has
questions that are empty strings), and an example with a blank sentence is still a valid (if uninformative) one; the
trainer reports the count.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Sequence

import torch

from .example import Example

__all__ = ["EncodedClassification", "encode_classification", "PAIR_SEPARATOR", "pair_separator"]

_BATCH = 1024

#: Put before the second sentence of a pair by a tokenizer whose pair template adds nothing between the two.
PAIR_SEPARATOR = "\n"


class EncodedClassification(NamedTuple):
    """``features``: one dict per example with ``input_ids`` and ``attention_mask`` (lists of ints),
    ``token_type_ids`` when the tokenizer produces them, and ``labels`` (0-d tensor, int64 or float32);
    ``n_truncated``: how many examples lost tokens to ``max_length``; ``n_blank``: how many have a blank sentence."""

    features: List[Dict[str, Any]]
    n_truncated: int
    n_blank: int = 0  # examples with a blank sentence (text_a, or text_b of a pair)


def _label_tensor(label, num_labels: int, i: int) -> torch.Tensor:
    if num_labels == 1:
        if isinstance(label, bool) or not isinstance(label, (int, float)):
            raise ValueError(f"example {i}: regression label {label!r} is not a number")
        return torch.tensor(float(label), dtype=torch.float32)
    if isinstance(label, bool) or not isinstance(label, int):
        raise ValueError(f"example {i}: label {label!r} is not an integer class index (num_labels={num_labels}; "
                         f"use num_labels=1 for a regression)")
    if not 0 <= label < num_labels:
        raise ValueError(f"example {i}: label {label} outside 0..{num_labels - 1}")
    return torch.tensor(label, dtype=torch.int64)


def pair_separator(tokenizer) -> str:
    """The text put before a pair's second sentence: :data:`PAIR_SEPARATOR` when the tokenizer's pair template adds no
    special token beyond the single-sentence one (nothing between the sentences), else ``""``."""
    marks = tokenizer.num_special_tokens_to_add(pair=True) > tokenizer.num_special_tokens_to_add(pair=False)
    return "" if marks else PAIR_SEPARATOR


def encode_classification(examples: Sequence[Example], tokenizer, max_length: int,
                          num_labels: int) -> EncodedClassification:
    """Tokenise ``examples`` (all single sentences or all pairs) with truncation to ``max_length``."""
    if int(max_length) < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if int(num_labels) < 1:
        raise ValueError(f"num_labels must be >= 1 (1 = regression), got {num_labels}")
    if len(examples) == 0:
        raise ValueError("no examples to encode")
    has_b = {ex.text_b is not None for ex in examples}
    if len(has_b) != 1:
        raise ValueError("mixed single-sentence and sentence-pair examples: text_b must be None for all or none")
    pair = has_b.pop()
    labels = [_label_tensor(ex.label, int(num_labels), i) for i, ex in enumerate(examples)]
    sep = pair_separator(tokenizer) if pair else ""

    features: List[Dict[str, Any]] = []
    n_truncated = 0
    for start in range(0, len(examples), _BATCH):
        chunk = examples[start:start + _BATCH]
        a = [ex.text_a for ex in chunk]
        b = [sep + ex.text_b for ex in chunk] if pair else None
        full = tokenizer(a, b, add_special_tokens=True, truncation=False, verbose=False)
        cut = tokenizer(a, b, add_special_tokens=True, truncation=True, max_length=int(max_length))
        for j in range(len(chunk)):
            n_truncated += int(len(full["input_ids"][j]) > int(max_length))
            feat = {k: list(cut[k][j]) for k in ("input_ids", "attention_mask", "token_type_ids") if k in cut}
            feat["labels"] = labels[start + j]
            features.append(feat)
    n_blank = sum(not ex.text_a.strip() or (pair and not ex.text_b.strip()) for ex in examples)
    return EncodedClassification(features, n_truncated, n_blank)
