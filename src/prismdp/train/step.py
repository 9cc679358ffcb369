"""One logical step's forward/backward work, shared by ``prismdp train`` and the diagnostics.

A Poisson batch of indices is split into micro-batches of at most ``micro_batch_size`` examples; with
``group_by_length`` its examples are first ordered by length, so that each micro-batch is padded to the length of
similar examples (on SST-2 at 128 examples per step and 32 per micro-batch: 2,600 instead of 5,200 padded tokens).
The order of examples inside a logical batch changes nothing in the mechanism (per-example gradients are clipped and
summed), so this is free of privacy consequences; it only changes which dropout mask an example gets.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from ..data.collate import pad_collate
from ..engine import to_device
from ..privacy import split_micro_batches

__all__ = ["host_list", "micro_batches", "unit_micro_batches", "micro_batch_plan", "backward_micro_batches",
           "backward_batch", "model_inputs"]


def model_inputs(batch: dict, device: torch.device | None = None) -> dict:
    """The model's input tensors of a collated batch (on ``device`` if given; pinned and asynchronous to CUDA)."""
    return {k: to_device(v, device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


def host_list(indices) -> list[int]:
    """The sampled indices (a tensor on the host, or any sequence) as a list of ints, in one read."""
    return indices.tolist() if torch.is_tensor(indices) else [int(i) for i in indices]


def micro_batches(indices: Sequence[int], examples: Sequence[dict], micro_batch_size: int,
                  group_by_length: bool = True) -> Iterator[list[int]]:
    """The micro-batches (lists of indices into ``examples``) of one logical batch."""
    order = host_list(indices)
    if group_by_length:
        order.sort(key=lambda i: len(examples[i]["input_ids"]))
    return split_micro_batches(order, micro_batch_size)


def unit_micro_batches(units: Sequence[Sequence[int]], examples: Sequence[dict], micro_batch_size: int,
                       group_by_length: bool = True) -> Iterator[tuple[list[int], list[int]]]:
    """Micro-batches of whole privacy units (user-level privacy): ``(example indices, unit of each example numbered
    0..g-1)``, filled up to ``micro_batch_size`` examples without splitting a unit (a larger unit gets a micro-batch
    of its own)."""
    order = list(range(len(units)))
    if group_by_length:
        order.sort(key=lambda u: max(len(examples[i]["input_ids"]) for i in units[u]))
    micro: list[int] = []
    groups: list[int] = []
    for u in order:
        if micro and len(micro) + len(units[u]) > micro_batch_size:
            yield micro, groups
            micro, groups = [], []
        g = groups[-1] + 1 if groups else 0
        micro += list(units[u])
        groups += [g] * len(units[u])
    if micro:
        yield micro, groups


def micro_batch_plan(indices, examples: Sequence[dict] | None, micro_batch_size: int, group_by_length: bool = True,
                     units: Sequence[Sequence[int]] | None = None) -> list[tuple[list[int], list[int] | None]]:
    """The micro-batches of one logical batch as ``(example indices, unit of each example numbered 0..g-1 or
    None)``.  With ``units`` (user-level privacy) ``indices`` are units, each the list ``units[u]`` of its examples,
    kept whole in one micro-batch.  ``examples`` (for their lengths) may be None without ``group_by_length``."""
    if units is None:
        return [(m, None) for m in micro_batches(indices, examples, micro_batch_size, group_by_length)]
    return list(unit_micro_batches([units[u] for u in host_list(indices)], examples, micro_batch_size, group_by_length))


def backward_micro_batches(private, micros: list[tuple[list[int], list[int] | None]],
                           losses_of: Callable[[list[int]], Tensor]) -> Tensor:
    """The micro-batch loop of one logical step (``prismdp train``, the diagnostics and the Hugging Face Trainer):
    ``losses_of(example indices)`` -> (b,) per-example losses, each micro-batch through ``private.backward`` (the
    optimizer step is the caller's).  How the micro-steps run across the processes of a run (a rank with fewer
    micro-batches runs idle ones where the base is sharded) is the engine's, :meth:`PrivateLoRA.run_micro_steps`.
    Returns ``[summed per-example loss, number of examples]`` over every rank, a float64 tensor left on the losses'
    device (both private: not covered by the DP guarantee): nothing here waits for the device; the caller reads it
    once, with the step's other numbers."""
    total, n = None, 0

    def micro_step(micro: list[int], groups: list[int] | None) -> None:
        nonlocal total, n
        losses = losses_of(micro)
        private.backward(losses, groups=groups)
        summed = losses.detach().sum().double()  # as float(): a float64 sum of the micro-batches' own sums
        total = summed if total is None else total + summed
        n += losses.numel()

    private.run_micro_steps(micros, micro_step, lambda: losses_of([0]))  # idle micro-steps: example 0, discarded
    total = torch.zeros((), dtype=torch.float64) if total is None else total
    totals = torch.stack([total, torch.full_like(total, float(n))])  # filled on the device: no copy, no wait
    private.processes.sum([totals], "training loss")  # the logged loss is the global batch's
    return totals


def backward_batch(private, model, examples: Sequence[dict], loss_fn, indices, micro_batch_size: int, pad_id: int,
                   device: torch.device | None = None, group_by_length: bool = True,
                   units: Sequence[Sequence[int]] | None = None) -> Tensor:
    """Forward and backward every micro-batch of one logical batch of tokenised ``examples`` (padded with
    ``pad_id``; see :func:`micro_batch_plan` and :func:`backward_micro_batches`).  Returns the loss totals on the
    device, unread: ``prismdp train`` hands them to ``private.queue_step`` and reads them with the step's other
    numbers, after the optimizer step is queued (:class:`prismdp.engine.StepReport`)."""

    def losses_of(micro: list[int]) -> Tensor:
        feats = pad_collate([examples[i] for i in micro], pad_id)
        return loss_fn(model(**model_inputs(feats, device)).logits, to_device(feats["labels"], device))

    plan = micro_batch_plan(indices, examples, micro_batch_size, group_by_length, units)
    return backward_micro_batches(private, plan, losses_of)
