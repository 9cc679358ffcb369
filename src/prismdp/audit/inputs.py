"""Input canaries (black-box): training examples of random tokens with random labels.

Each canary is an ordinary example (classification: random tokens and a uniformly random label; causal LM: random
tokens that are their own targets).  The included ones join the training set before the run is made private, so they
are sampled, clipped and noised like every other example.  A canary's score is how much the run lowered its loss:
``loss(base model) - loss(trained model)``, both in eval mode (a model that memorised its random label scores high).
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from ..data.collate import pad_collate
from ..train.step import model_inputs

__all__ = ["make_input_canaries", "canary_losses"]


def make_input_canaries(m: int, root: int, tokenizer, task_type: str, num_labels: int | None, length: int,
                        like: dict) -> list[dict]:
    """``m`` canary examples drawn from ``random.Random(root)`` (public: the secret is which ones train), shaped like
    the training example ``like`` (the same keys)."""
    if task_type == "seq_cls" and (num_labels is None or num_labels < 2):
        raise ValueError("input canaries need a classification task with >= 2 labels or a causal-LM task "
                         "(random labels of a regression task are not a membership signal); use --canary-kind gradient")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(root)
    out = []
    for _ in range(m):
        ids = [rng.choice(vocab) for _ in range(length)]
        ex = {"input_ids": ids, "attention_mask": [1] * length}
        if "token_type_ids" in like:
            ex["token_type_ids"] = [0] * length
        ex["labels"] = rng.randrange(num_labels) if task_type == "seq_cls" else list(ids)
        out.append(ex)
    return out


@torch.no_grad()
def canary_losses(model, examples: Sequence[dict], loss_fn, pad_id: int, device, batch_size: int = 32) -> torch.Tensor:
    """Per-example losses of ``examples`` under ``model`` in eval mode (float64, on the CPU)."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(examples), batch_size):
        feats = pad_collate(list(examples[start:start + batch_size]), pad_id)
        logits = model(**model_inputs(feats, device)).logits
        out.append(loss_fn(logits, feats["labels"].to(device)).double().cpu())
    model.train(was_training)
    return torch.cat(out)
