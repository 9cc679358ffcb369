"""One logical step's forward/backward work, shared by ``prismdp train`` and the diagnostics.

A Poisson batch of indices is split into micro-batches of at most ``micro_batch_size`` examples; with
``group_by_length`` its examples are first ordered by length, so that each micro-batch is padded to the length of
similar examples (on SST-2 at 128 examples per step and 32 per micro-batch: 2,600 instead of 5,200 padded tokens).
The order of examples inside a logical batch changes nothing in the mechanism (per-example gradients are clipped and
summed), so this is free of privacy consequences; it only changes which dropout mask an example gets.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from ..data.collate import pad_collate
from ..privacy import split_micro_batches

__all__ = ["micro_batches", "backward_batch", "model_inputs"]


def model_inputs(batch: dict, device: torch.device | None = None) -> dict:
    """The model's input tensors of a collated batch (on ``device`` if given)."""
    return {k: v if device is None else v.to(device) for k, v in batch.items()
            if k in ("input_ids", "attention_mask", "token_type_ids")}


def micro_batches(indices: Sequence[int], examples: Sequence[dict], micro_batch_size: int,
                  group_by_length: bool = True) -> Iterator[list[int]]:
    """The micro-batches (lists of indices into ``examples``) of one logical batch."""
    order = [int(i) for i in indices]
    if group_by_length:
        order.sort(key=lambda i: len(examples[i]["input_ids"]))
    return split_micro_batches(order, micro_batch_size)


def backward_batch(private, model, examples: Sequence[dict], loss_fn, indices, micro_batch_size: int, pad_id: int,
                   device: torch.device | None = None, group_by_length: bool = True) -> tuple[float, int]:
    """Forward and backward every micro-batch of one logical batch through ``private.backward`` (the optimizer step
    is the caller's); returns the summed per-example loss and the number of examples (both private: not covered by
    the DP guarantee)."""
    loss_sum, n = 0.0, 0
    micros = list(micro_batches(indices, examples, micro_batch_size, group_by_length))
    agreed = private.micro_steps(len(micros))  # every rank of a multi-process run runs as many (some empty)
    for micro in micros + [[]] * (agreed - len(micros)):
        if not micro:
            continue  # an empty micro-batch: nothing to compute (no collective runs inside a micro-step)
        feats = pad_collate([examples[i] for i in micro], pad_id)
        losses = loss_fn(model(**model_inputs(feats, device)).logits, feats["labels"].to(device))
        private.backward(losses)
        loss_sum += float(losses.detach().sum())
        n += losses.numel()
    return loss_sum, n
