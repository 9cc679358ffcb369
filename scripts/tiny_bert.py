"""Save a tiny random-init BERT (2 layers, hidden 32) with the packaged MiniLM tokenizer as a local model folder.

The privacy audits of docs/privacy-audit.md train it: a white-box audit tests the mechanism, not the model, and this
one steps in well under a second on a CPU.

    python scripts/tiny_bert.py /tmp/tiny-bert
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from prismdp.models import default_encoder_path


def main(path: str) -> None:
    tok = AutoTokenizer.from_pretrained(default_encoder_path())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=128)
    BertForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)


if __name__ == "__main__":
    main(sys.argv[1])
