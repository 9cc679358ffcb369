"""Classification heads for encoders other than the checkpoint's own.

``MeanPoolingClassifier``: logits = Linear(dropout(masked mean of the last hidden states)).  Sentence encoders such
as all-MiniLM-L6-v2 were trained with this pooling (sentence-transformers' ``1_Pooling/config.json``:
``pooling_mode_mean_tokens``); BERT's own sequence-classification head reads the [CLS] state through a pooler that
such checkpoints never trained.  On the packaged MiniLM and 1,250 SST-2 examples a logistic regression on the
mean-pooled features reaches 0.77 validation accuracy against 0.66 on the pooler's (docs/results-cpu.md), and the
pooler's outputs are small (norm ~1.3) and nearly parallel across sentences, which is what DP noise drowns.

The head is an ordinary ``nn.Linear`` named ``classifier`` (PEFT's ``SEQ_CLS`` task saves it with the adapter; the
per-example gradient sampler covers it as a dense layer).  Pooling is per example, so per-example gradients stay
exact.  An adapter trained on this head applies to ``load_model(base, "seq_cls", num_labels, pooling="mean")``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

__all__ = ["POOLINGS", "MeanPoolingClassifier", "masked_mean"]

POOLINGS = ("model", "mean")  # "model": the checkpoint's own sequence-classification head


def masked_mean(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(b, T, h), (b, T) -> (b, h): the mean over each example's unmasked positions."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


class MeanPoolingClassifier(nn.Module):
    """An encoder (``AutoModel``) followed by masked mean pooling, dropout and a new linear classifier."""

    def __init__(self, encoder: nn.Module, num_labels: int):
        super().__init__()
        cfg = encoder.config
        self.encoder = encoder
        self.config = cfg
        p = getattr(cfg, "classifier_dropout", None)
        self.dropout = nn.Dropout(p if p is not None else getattr(cfg, "hidden_dropout_prob", 0.1))
        self.classifier = nn.Linear(cfg.hidden_size, num_labels, dtype=next(encoder.parameters()).dtype)
        nn.init.normal_(self.classifier.weight, std=getattr(cfg, "initializer_range", 0.02))
        nn.init.zeros_(self.classifier.bias)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, inputs_embeds=None, **unused):
        # PEFT's SEQ_CLS wrapper also passes labels, output_* and return_dict; the loss is the trainer's business.
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "inputs_embeds": inputs_embeds}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = self.encoder(**kwargs).last_hidden_state
        return SequenceClassifierOutput(logits=self.classifier(self.dropout(masked_mean(hidden, attention_mask))))
