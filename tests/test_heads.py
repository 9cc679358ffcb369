"""The mean-pooling classification head: exact pooling, exact per-example gradients, training, export, errors."""

import json

import pytest
import torch

from helpers import padded_batch
from prismdp.grad_sample import GradSampler
from prismdp.heads import MeanPoolingClassifier, masked_mean
from prismdp.lora import find_lora_pairs
from prismdp.losses import classification_losses
from prismdp.models import load_model
from prismdp.train.config import ConfigError, TrainConfig
from prismdp.train.loop import train


def test_masked_mean_is_the_mean_over_unpadded_positions():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    lengths = [6, 2, 4]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    out = masked_mean(h, mask)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out[i], h[i, :n].mean(0))
    torch.testing.assert_close(masked_mean(h, None), h.mean(1))


def _mean_model(tiny_bert_dir):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model, tok = load_model(tiny_bert_dir, "seq_cls", 2, pooling="mean")
    assert isinstance(model, MeanPoolingClassifier) and model.config.num_labels == 2
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                                            task_type="SEQ_CLS")), tok


def test_per_example_gradients_through_mean_pooling_equal_one_by_one(tiny_bert_dir):
    model, _ = _mean_model(tiny_bert_dir)
    model.eval()  # no dropout: the loop below must see the same function
    pairs = find_lora_pairs(model)
    for p in pairs:  # B = 0 at PEFT's init would make every A-gradient zero
        torch.nn.init.normal_(p.lora_B.weight, std=0.1)
    sampler = GradSampler(model, pairs)
    assert len(sampler.dense_params) == 2  # the new head's weight and bias, saved by PEFT as modules_to_save
    ids, mask = padded_batch([5, 12, 3, 8])
    labels = torch.tensor([0, 1, 1, 0])
    with sampler.record() as rec:
        classification_losses(model(input_ids=ids, attention_mask=mask).logits, labels).sum().backward()
    model.zero_grad(set_to_none=True)
    pe = sampler.grads(rec)
    for i in range(4):  # each example alone and unpadded: padding must not leak into the mean
        L = int(mask[i].sum())
        model.zero_grad(set_to_none=True)
        classification_losses(model(input_ids=ids[i:i + 1, :L], attention_mask=mask[i:i + 1, :L]).logits,
                              labels[i:i + 1]).sum().backward()
        for k, p in enumerate(pairs):
            torch.testing.assert_close(pe.lora[k][0][i], p.lora_B.weight.grad, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(pe.lora[k][1][i], p.lora_A.weight.grad.T, rtol=1e-4, atol=1e-6)
        for j, q in enumerate(sampler.dense_params):
            torch.testing.assert_close(pe.dense[j][i], q.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_mean_pooling_run_exports_an_adapter_that_reproduces_the_model(tiny_bert_dir, tmp_path, method):
    from peft import PeftModel

    out = tmp_path / "run"
    cfg = TrainConfig(model=tiny_bert_dir, task="synthetic", synthetic_train=96, synthetic_test=32, steps=3,
                      batch_size=16, micro_batch_size=8, rank=4, alpha=8, lr=5e-3, head_lr=1e-2, max_length=32,
                      output=str(out), pooling="mean", method=method)
    res = train(cfg, progress=False, log=lambda *a: None)
    assert json.loads((out / "config.json").read_text())["pooling"] == "mean"
    assert json.loads((out / "adapter" / "prismdp_head.json").read_text()) == {"pooling": "mean", "num_labels": 2}
    base, _ = load_model(tiny_bert_dir, "seq_cls", 2, pooling="mean")
    loaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    res.model.eval()
    ids = torch.randint(1000, 5000, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        diff = (loaded(input_ids=ids, attention_mask=mask).logits
                - res.model(input_ids=ids, attention_mask=mask).logits).abs().max().item()
    assert diff < 1e-4
    head = res.model.base_model.model.classifier
    assert not torch.equal(head.modules_to_save["default"].weight, head.original_module.weight)  # it trained


def test_pooling_errors_name_the_fix():
    with pytest.raises(ConfigError, match="pooling: must be 'model'"):
        TrainConfig(pooling="max")
    with pytest.raises(ConfigError, match="pooling: 'mean' builds a classification head"):
        TrainConfig(task="glue8", pooling="mean")
    with pytest.raises(ValueError, match="needs task_type='seq_cls' and num_labels"):
        load_model(None, "causal_lm", pooling="mean")
    with pytest.raises(ValueError, match="pooling must be one of"):
        load_model(None, "seq_cls", 2, pooling="cls")


def test_cli_pooling_and_device_flags_reach_the_run(tiny_bert_dir, tmp_path):
    from prismdp.cli import main

    out = tmp_path / "run"
    assert main(["train", "--model", tiny_bert_dir, "--steps", "1", "--batch-size", "16", "--micro-batch-size", "8",
                 "--rank", "2", "--max-length", "24", "--output", str(out), "--quiet", "--pooling", "mean",
                 "--device", "cpu", "--head-lr", "1e-2"]) == 0
    resolved = json.loads((out / "config.json").read_text())
    assert (resolved["pooling"], resolved["device"], resolved["torch_device"], resolved["head_lr"]) == \
        ("mean", "cpu", "cpu", 1e-2)
    assert (out / "adapter" / "prismdp_head.json").is_file()
