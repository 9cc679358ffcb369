"""Right-padding collation of tokenised examples into a batch of tensors (classification and causal LM).

Each feature is a mapping with ``input_ids`` (list of ints or 1-d tensor) and optionally ``attention_mask``
(default: all ones), ``token_type_ids`` (padded with 0) and ``labels``:

* a sequence of the same length as ``input_ids`` (causal LM): padded with ``label_pad_id`` (-100);
* a scalar (int/float or 0-d tensor; classification/regression): stacked, keeping a tensor label's dtype,
  python ints -> int64, python floats -> float32.

Other keys (``truncated``, ``prompt_len``, ...) are metadata and are not collated.  Padding is on the right;
``pad_to_multiple_of`` rounds the padded length up.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

__all__ = ["pad_collate"]


def _as_list(x, key: str, i: int) -> List[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"feature {i}: {key} must be 1-d, got shape {tuple(x.shape)}")
        return x.tolist()
    return list(x)


def _is_scalar(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dim() == 0
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def pad_collate(features: Sequence[Mapping[str, Any]], pad_token_id: int, *, label_pad_id: int = -100,
                pad_to_multiple_of: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Pad ``features`` to a common length; return ``input_ids``, ``attention_mask`` (int64), and
    ``token_type_ids`` / ``labels`` when the features have them."""
    if len(features) == 0:
        raise ValueError("pad_collate: empty list of features")
    if pad_token_id is None:
        raise ValueError("pad_collate: pad_token_id is None (set tokenizer.pad_token; load_model does)")
    ids = []
    for i, f in enumerate(features):
        if "input_ids" not in f:
            raise KeyError(f"feature {i} has no 'input_ids' (keys: {sorted(f)})")
        ids.append(_as_list(f["input_ids"], "input_ids", i))
    if any(len(x) == 0 for x in ids):
        raise ValueError("pad_collate: a feature has no tokens")
    length = max(len(x) for x in ids)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    n = len(features)

    def padded(key: str, fill: int, default=None) -> torch.Tensor:
        out = torch.full((n, length), fill, dtype=torch.int64)
        for i, f in enumerate(features):
            seq = _as_list(f[key], key, i) if key in f else default(len(ids[i]))
            if len(seq) != len(ids[i]):
                raise ValueError(f"feature {i}: {key} has length {len(seq)} but input_ids has {len(ids[i])}")
            out[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
        return out

    batch = {
        "input_ids": padded("input_ids", int(pad_token_id)),
        "attention_mask": padded("attention_mask", 0, default=lambda k: [1] * k),
    }
    if any("token_type_ids" in f for f in features):
        batch["token_type_ids"] = padded("token_type_ids", 0, default=lambda k: [0] * k)

    with_labels = ["labels" in f for f in features]
    if any(with_labels):
        if not all(with_labels):
            raise ValueError("pad_collate: some features have 'labels' and some do not")
        scalar = [_is_scalar(f["labels"]) for f in features]
        if all(scalar):
            vals = [f["labels"] for f in features]
            if all(isinstance(v, torch.Tensor) for v in vals):
                batch["labels"] = torch.stack(vals)
            elif any(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.is_floating_point())
                     for v in vals):
                batch["labels"] = torch.tensor([float(v) for v in vals], dtype=torch.float32)
            else:
                batch["labels"] = torch.tensor([int(v) for v in vals], dtype=torch.int64)
        elif not any(scalar):
            batch["labels"] = padded("labels", int(label_pad_id))
        else:
            raise ValueError("pad_collate: mixed scalar and sequence labels")
    return batch
