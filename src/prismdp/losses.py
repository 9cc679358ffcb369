"""Per-example losses: each example's loss depends on that example alone, and the batch loss is their sum.

This is what makes per-example gradients (and hence the clipping bound) exact.  A token-mean over the whole
micro-batch (the paper's reference code) couples examples through their token counts; a mean over the batch
rescales every gradient by the realised batch size.  Neither is used here.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["classification_losses", "causal_lm_losses"]


def classification_losses(logits: Tensor, labels: Tensor) -> Tensor:
    """(b,) cross-entropy per example; mean-squared error when ``logits`` has one column (regression)."""
    if logits.shape[-1] == 1:
        return (logits.squeeze(-1).float() - labels.float()).square()
    return F.cross_entropy(logits.float(), labels, reduction="none")


def causal_lm_losses(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """(b,) next-token loss per example over its own target tokens (``labels != -100``).

    ``reduction="mean"`` averages over the example's own target tokens (0 if it has none); ``"sum"`` sums them.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    tok = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none")
    total = tok.sum(dim=1)
    if reduction == "sum":
        return total
    count = (shift_labels != -100).sum(dim=1)
    return total / count.clamp_min(1)
