"""LoRA pairs as rank-r points: discovery, validation, the compensated start."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification

from helpers import padded_batch, tiny_bert_cls, tiny_llama
from prismdp import geometry
from prismdp.export import export_adapter
from prismdp.lora import (LoraSetupError, StartDropoutCompensation, find_lora_pairs, get_factors, set_factors,
                          move_to_rank_r_start)
from prismdp.optim import PRISM


def test_pairs_found_with_shapes_and_scaling():
    model = tiny_bert_cls(r=4, targets=("query", "value", "dense"))
    pairs = find_lora_pairs(model)
    assert len(pairs) == 2 * (2 + 3) + 1  # per block: query, value, 3 "dense" layers; plus the pooler
    for p in pairs:
        m, n, r = p.shape
        assert p.lora_B.weight.shape == (m, r) and p.lora_A.weight.shape == (r, n)
        assert p.scaling == pytest.approx(2.0)


def test_intrinsic_parameter_includes_scaling():
    model = tiny_bert_cls()
    pair = find_lora_pairs(model)[0]
    move_to_rank_r_start(find_lora_pairs(model))
    A, B = get_factors(pair, torch.float64)
    delta = pair.layer.get_delta_weight("default").double()  # PEFT's own scaling * W_B W_A
    torch.testing.assert_close(A @ B.T, delta, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("init", ["spectral", "random"])
def test_rank_r_start_keeps_outputs_and_balances(init):
    model = tiny_bert_cls(seed=3)
    ids, mask = padded_batch([7, 4, 9])
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    pairs = find_lora_pairs(model)
    start = move_to_rank_r_start(pairs, init=init, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    for pair, (A0, B0) in zip(pairs, start.factors):
        A, B = get_factors(pair, torch.float64)
        torch.testing.assert_close(A.T @ A, B.T @ B, rtol=1e-5, atol=1e-6)
        assert torch.linalg.matrix_rank(A @ B.T) == pair.shape[2]
        torch.testing.assert_close((A @ B.T).float(), A0 @ B0.T, rtol=1e-5, atol=1e-6)


def _train_logits(model, ids, mask, seed=5):
    torch.manual_seed(seed)  # the same dropout masks in every call
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_lora_dropout_acts_on_the_update_only_after_the_rank_r_start(tmp_path):
    """Train mode, dropout 0.5: the started model computes W0 x + (Z - Z0) drop(x), as ordinary LoRA and the
    exported adapter on the original base do, not (W0 - Z0) x + Z drop(x)."""
    from peft import PeftModel

    model = tiny_bert_cls(seed=2, dropout=0.5).double().train()
    original = get_peft_model(model.get_base_model().__class__(model.get_base_model().config).double(),
                              model.peft_config["default"])  # a second model to receive the original weights
    original.load_state_dict(model.state_dict())
    ids, mask = padded_batch([7, 4, 9])
    before = _train_logits(model, ids, mask)
    pairs = find_lora_pairs(model)
    start = move_to_rank_r_start(pairs)
    assert start.dropout_compensation.active
    torch.testing.assert_close(_train_logits(model, ids, mask), before, rtol=0, atol=1e-10)
    start.dropout_compensation.remove()  # the test has power: uncompensated, dropout hits Z0 x
    assert (_train_logits(model, ids, mask) - before).abs().max() > 1e-6  # vs < 1e-10 compensated
    start.dropout_compensation = StartDropoutCompensation(pairs, start.factors)

    g = torch.Generator().manual_seed(0)
    for pair in pairs:  # move Z away from Z0, as training does
        A, B = get_factors(pair, torch.float64)
        set_factors(pair, A + 0.3 * torch.randn(A.shape, generator=g, dtype=A.dtype),
                    B + 0.3 * torch.randn(B.shape, generator=g, dtype=B.dtype))
    export_adapter(model, pairs, start, tmp_path / "adapter")
    exported = PeftModel.from_pretrained(original.unload(), tmp_path / "adapter").double().train()
    torch.testing.assert_close(_train_logits(model, ids, mask), _train_logits(exported, ids, mask),
                               rtol=0, atol=1e-5)
    model.eval()  # eval mode: nothing is added (dropout is the identity)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   exported.eval()(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=1e-5)


class _UnfusedCompensation:
    """The reference: ``Z0 (x - drop(x))`` added by autograd-recorded tensor operations (pre-hook on lora_A keeps
    drop(x), a forward hook on the layer adds ``((x - drop(x)) B0) A0^T``), as the first implementation did."""

    def __init__(self, pairs, factors):
        self.handles = []
        for pair, (a0, b0) in zip(pairs, factors):
            seen = []

            def keep(module, args, seen=seen):
                seen.append(args[0])

            def add(module, args, output, seen=seen, a0=a0, b0=b0):
                xd = seen.pop()
                return output + ((args[0] - xd) @ b0.to(xd.dtype)) @ a0.to(xd.dtype).T

            self.handles += [pair.lora_A.register_forward_pre_hook(keep), pair.layer.register_forward_hook(add)]

    def remove(self):
        for h in self.handles:
            h.remove()


def _moved_train_model(seed=2):
    """A float64 tiny BERT in train mode (LoRA dropout 0.5) on its rank-r start, with Z moved away from Z0."""
    model = tiny_bert_cls(seed=seed, dropout=0.5).double().train()
    pairs = find_lora_pairs(model)
    start = move_to_rank_r_start(pairs)
    g = torch.Generator().manual_seed(1)
    for pair in pairs:
        A, B = get_factors(pair, torch.float64)
        set_factors(pair, A + 0.3 * torch.randn(A.shape, generator=g, dtype=A.dtype),
                    B + 0.3 * torch.randn(B.shape, generator=g, dtype=B.dtype))
    return model, pairs, start


def _losses_and_grads(model, pairs, ids, mask, labels, seed=5):
    from prismdp.grad_sample import GradSampler
    from prismdp.losses import classification_losses

    sampler = GradSampler(model, pairs)
    torch.manual_seed(seed)  # the same dropout masks in every call
    with sampler.record() as rec:
        losses = classification_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
        losses.sum().backward()
    grads = [(p.lora_B.weight.grad.clone(), p.lora_A.weight.grad.clone()) for p in pairs]
    model.zero_grad(set_to_none=True)
    sampler.close()
    return losses.detach(), grads, sampler.grads(rec)


def test_fused_compensation_equals_the_unfused_one_with_gradients_and_per_example_gradients():
    """Float64, train mode, dropout 0.5, a second layer whose input depends on the first layer's factors (so the
    backward's gradient with respect to x and drop(x) is exercised): losses, summed factor gradients and the
    gradient sampler's per-example gradients of the fused compensation equal the unfused reference's."""
    model, pairs, start = _moved_train_model()
    ids, mask = padded_batch([7, 4, 9])
    labels = torch.tensor([0, 1, 1])
    fused = _losses_and_grads(model, pairs, ids, mask, labels)
    start.dropout_compensation.remove()
    none = _losses_and_grads(model, pairs, ids, mask, labels)
    reference = _UnfusedCompensation(pairs, start.factors)
    unfused = _losses_and_grads(model, pairs, ids, mask, labels)
    reference.remove()
    assert (fused[0] - none[0]).abs().max() > 1e-6  # the compensation matters at this dropout
    torch.testing.assert_close(fused[0], unfused[0], rtol=0, atol=1e-12)
    for (gb, ga), (rb, ra), (nb, na) in zip(fused[1], unfused[1], none[1]):
        torch.testing.assert_close(gb, rb, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ga, ra, rtol=1e-10, atol=1e-12)
    assert max((ga - na).abs().max() for (_, ga), (_, na) in zip(fused[1], none[1])) > 1e-6
    pe_fused, pe_ref = fused[2], unfused[2]
    for k in range(len(pairs)):
        for part in (0, 1):
            torch.testing.assert_close(pe_fused.lora[k][part], pe_ref.lora[k][part], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(pe_fused.lora[k][0].sum(0), fused[1][k][0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(pe_fused.lora[k][1].sum(0), fused[1][k][1].T, rtol=1e-10, atol=1e-12)


def test_no_compensation_hooks_without_dropout():
    model = tiny_bert_cls(dropout=0.0)
    assert not move_to_rank_r_start(find_lora_pairs(model)).dropout_compensation.active


def test_spectral_start_is_top_r_part_of_base_weight():
    model = tiny_bert_cls(seed=1)
    pair = find_lora_pairs(model)[0]
    W0 = pair.layer.get_base_layer().weight.detach().double().clone()
    move_to_rank_r_start([pair], init="spectral")
    A, B = get_factors(pair, torch.float64)
    U, S, Vh = torch.linalg.svd(W0)
    r = pair.shape[2]
    torch.testing.assert_close(A @ B.T, U[:, :r] @ torch.diag(S[:r]) @ Vh[:r], rtol=1e-5, atol=1e-5)


def test_prism_refuses_peft_zero_init():
    model = tiny_bert_cls()
    with pytest.raises(LoraSetupError, match="move_to_rank_r_start"):
        PRISM(find_lora_pairs(model), lr=1e-3)


def test_no_lora_pairs_is_a_clear_error():
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    with pytest.raises(LoraSetupError, match="get_peft_model"):
        find_lora_pairs(BertForSequenceClassification(cfg))


def test_rank_too_large_is_a_clear_error():
    with pytest.raises(LoraSetupError, match="r=32 >= min"):
        find_lora_pairs(tiny_bert_cls(r=32))


def test_unsupported_lora_layer_type_is_a_clear_error():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    model = get_peft_model(BertForSequenceClassification(cfg), LoraConfig(r=2, target_modules=["word_embeddings", "query"]))
    with pytest.raises(LoraSetupError, match="Linear layers only"):
        find_lora_pairs(model)


def test_dora_is_a_clear_error():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    model = get_peft_model(BertForSequenceClassification(cfg), LoraConfig(r=2, target_modules=["query"], use_dora=True))
    with pytest.raises(LoraSetupError, match="use_dora=False"):
        find_lora_pairs(model)


def test_causal_lm_pairs_and_start():
    model = tiny_llama()
    ids, mask = padded_batch([6, 3], vocab=120)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    pairs = find_lora_pairs(model)
    assert {p.name.split(".")[-1] for p in pairs} == {"q_proj", "v_proj", "up_proj", "down_proj"}
    move_to_rank_r_start(pairs)
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)


def test_balance_is_gauge_free():
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(9, 3, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g, dtype=torch.float64)
    R = torch.randn(3, 3, generator=g, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
    A1, B1 = geometry.balance(A, B)
    A2, B2 = geometry.balance(A @ R, B @ torch.linalg.inv(R).T)
    # balanced factors of the same Z agree up to an orthogonal rotation: compare the invariants
    torch.testing.assert_close(A1 @ B1.T, A2 @ B2.T)
    torch.testing.assert_close(A1 @ A1.T, A2 @ A2.T)
