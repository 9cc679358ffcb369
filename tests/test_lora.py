"""LoRA pairs as rank-r points: discovery, validation, the compensated start."""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification

from helpers import padded_batch, tiny_bert_cls, tiny_llama
from prismdp import geometry
from prismdp.export import export_adapter
from prismdp.lora import (LoraSetupError, find_lora_pairs, freeze_lora_A, get_factors, move_to_rank_r_start,
                          set_factors)
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


def _move_factors(pairs, seed=1, step=0.3):
    """Move every Z away from Z0, as training does."""
    g = torch.Generator().manual_seed(seed)
    for pair in pairs:
        A, B = get_factors(pair, torch.float64)
        set_factors(pair, A + step * torch.randn(A.shape, generator=g, dtype=A.dtype),
                    B + step * torch.randn(B.shape, generator=g, dtype=B.dtype))


def _base_weights(pairs):
    return [pair.layer.get_base_layer().weight.detach().clone() for pair in pairs]


def _delta(pair):
    """s W_B W_A, float64 (m, n)."""
    return pair.scaling * pair.lora_B.weight.detach().double() @ pair.lora_A.weight.detach().double()


def _layer_io(model, pairs, run):
    """Per pair, the layer's input x, its LoRA dropout's output drop(x) and the layer's output y during ``run()``."""
    seen = [{} for _ in pairs]
    handles = []
    for k, pair in enumerate(pairs):
        def layer_hook(module, args, output, k=k):
            seen[k].update(x=args[0].detach(), y=output.detach())

        def drop_hook(module, args, output, k=k):
            seen[k]["xd"] = output.detach()

        handles += [pair.layer.register_forward_hook(layer_hook),
                    pair.layer.lora_dropout[pair.adapter].register_forward_hook(drop_hook)]
    run()
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_started_layers_compute_W0_x_plus_the_update_on_dropped_inputs(arch):
    """Float64, LoRA dropout 0.5, after a non-zero move of every Z: in train mode each started layer outputs exactly
    ``W0 x + b + (Z - Z0) drop(x)`` with the mask of that forward pass (not ``(W0 - Z0) x + Z drop(x)``, which
    differs by ``Z0 (x - drop(x))``), in eval mode ``(W0 + Z - Z0) x + b``; the base keeps W0 bit for bit.
    Fails without the compensation (checked by hand: with ``_StartedLoraB`` returning ``W_B h`` alone, and with the
    uncompensated start on a base holding W0 - Z0, the outputs differ by up to 0.4)."""
    model = (tiny_bert_cls(seed=2, dropout=0.5, targets=("query", "value", "dense")) if arch == "encoder"
             else tiny_llama(seed=2, dropout=0.5)).double().train()
    ids, mask = padded_batch([7, 4, 9], vocab=100)
    pairs = find_lora_pairs(model)
    W0 = _base_weights(pairs)
    move_to_rank_r_start(pairs)
    Z0 = [_delta(pair) for pair in pairs]
    _move_factors(pairs)
    for pair, w in zip(pairs, W0):
        assert torch.equal(pair.layer.get_base_layer().weight, w)

    def run():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)

    for training in (True, False):
        model.train(training)
        for pair, w, z0, io in zip(pairs, W0, Z0, _layer_io(model, pairs, run)):
            base = pair.layer.get_base_layer()
            x, xd, y = io["x"], io.get("xd", io["x"]), io["y"]
            update = _delta(pair) - z0
            assert float(update.abs().max()) > 0.1
            if training:
                assert float((xd - x).abs().max()) > 0.1  # the mask dropped something
                assert float((F.linear(x - xd, z0)).abs().max()) > 1e-3  # what the compensation is worth here
            want = F.linear(x, w, base.bias) + F.linear(xd, update)
            torch.testing.assert_close(y, want, rtol=0, atol=1e-12)


def test_started_model_with_dropout_exports_the_trained_function(tmp_path):
    """Train mode, dropout 0.5, float64: the started model computes the model it started from (step 0); after a
    move of every Z, the exported rank-2r adapter loaded by stock PEFT on the original base computes the trained
    model's function in train mode (same dropout masks) and in eval mode, and so does PEFT's merge."""
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
    assert set(model.state_dict()) == set(original.state_dict())  # the start adds no state-dict keys

    _move_factors(pairs, seed=0)
    export_adapter(model, pairs, start, tmp_path / "adapter")
    exported = PeftModel.from_pretrained(original.unload(), tmp_path / "adapter").double().train()
    # up to the float32 record of A0 and B0 that the export reads
    torch.testing.assert_close(_train_logits(model, ids, mask), _train_logits(exported, ids, mask),
                               rtol=0, atol=1e-6)
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(trained, exported.eval()(input_ids=ids, attention_mask=mask).logits,
                                   rtol=0, atol=1e-6)
        # PEFT's own merge puts W0 + Z - Z0 into the base (get_delta_weight is Z - Z0 here), and unmerge undoes it
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, trained, rtol=0, atol=1e-10)
        model.unmerge_adapter()
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, trained, rtol=0, atol=1e-10)
        merged = model.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=mask).logits, trained, rtol=0, atol=1e-10)


def test_removing_the_compensation_restores_the_plain_start():
    """``dropout_compensation.remove()`` (the benchmarks' ablation): plain PEFT modules on a base holding W0 - Z0,
    the same eval-mode model, but train-mode dropout now also hits Z0 x."""
    model = tiny_bert_cls(seed=2, dropout=0.5).double()
    ids, mask = padded_batch([7, 4, 9])
    pairs = find_lora_pairs(model)
    W0 = _base_weights(pairs)
    start = move_to_rank_r_start(pairs)
    _move_factors(pairs)
    model.train()
    train_before = _train_logits(model, ids, mask)
    model.eval()
    eval_before = _train_logits(model, ids, mask)
    start.dropout_compensation.remove()
    assert not start.dropout_compensation.active
    for pair, w, (a0, b0) in zip(pairs, W0, start.factors):
        assert type(pair.lora_A) is torch.nn.Linear and type(pair.lora_B) is torch.nn.Linear
        torch.testing.assert_close(pair.layer.get_base_layer().weight, w - (a0 @ b0.T).double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(_train_logits(model, ids, mask), eval_before, rtol=0, atol=1e-10)
    model.train()
    assert float((_train_logits(model, ids, mask) - train_before).abs().max()) > 1e-6  # vs < 1e-10 above


class _UnfusedCompensation:
    """The reference: the first implementation on a base holding ``W0 - Z0``: ``Z0 (x - drop(x))`` added by
    autograd-recorded tensor operations (pre-hook on lora_A keeps drop(x), a forward hook on the layer adds
    ``((x - drop(x)) B0) A0^T``)."""

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


def _losses_and_grads(model, pairs, ids, mask, labels, seed=5):
    from prismdp.grad_sample import GradSampler
    from prismdp.losses import classification_losses

    sampler = GradSampler(model, pairs)
    sampler.summed_lora_grads = True  # autograd's summed .grad too: a second oracle for the per-example gradients
    torch.manual_seed(seed)  # the same dropout masks in every call
    with sampler.record() as rec:
        losses = classification_losses(model(input_ids=ids, attention_mask=mask).logits, labels)
        losses.sum().backward()
    grads = [tuple(p.grad.clone() for p in pair.trained_params) for pair in pairs]
    model.zero_grad(set_to_none=True)
    # as training records them (no summed .grad, the factors' forward without requires_grad): the same gradients
    sampler.summed_lora_grads = False
    torch.manual_seed(seed)
    with sampler.record() as bare:
        classification_losses(model(input_ids=ids, attention_mask=mask).logits, labels).sum().backward()
    assert all(p.grad is None for pair in pairs for p in pair.trained_params)
    for got, ref in zip(sampler.grads(bare).lora, sampler.grads(rec).lora):
        for g, r in zip(got, ref):
            assert (g is None) == (r is None) and (g is None or torch.equal(g, r))
    model.zero_grad(set_to_none=True)
    sampler.close()
    return losses.detach(), grads, sampler.grads(rec)


@pytest.mark.parametrize("trainable", ["both", "B"])
def test_compensated_branch_gives_the_gradients_of_the_hook_reference(trainable):
    """Float64, train mode, dropout 0.5, every Z moved, a second layer whose input depends on the first layer's
    factors (so gradients flow through x and drop(x)): losses, summed factor gradients and the gradient sampler's
    per-example gradients of the started model equal those of the reference (base W0 - Z0, plain LoRA, hooks adding
    Z0 (x - drop(x)) by autograd); ``trainable="B"``: lora_A frozen (FFA-LoRA from the rank-r start)."""
    model = tiny_bert_cls(seed=2, dropout=0.5).double().train()
    if trainable == "B":
        freeze_lora_A(model)
    pairs = find_lora_pairs(model, trainable=trainable)
    start = move_to_rank_r_start(pairs)
    _move_factors(pairs)
    ids, mask = padded_batch([7, 4, 9])
    labels = torch.tensor([0, 1, 1])
    fused = _losses_and_grads(model, pairs, ids, mask, labels)
    z0 = [(-pair.scaling * pair.lora_B.start_c0, pair.lora_A.start_b0t.T) for pair in pairs]  # float64 (A0, B0)
    start.dropout_compensation.remove()
    none = _losses_and_grads(model, pairs, ids, mask, labels)
    reference = _UnfusedCompensation(pairs, z0)
    unfused = _losses_and_grads(model, pairs, ids, mask, labels)
    reference.remove()
    assert (fused[0] - none[0]).abs().max() > 1e-6  # the compensation matters at this dropout
    torch.testing.assert_close(fused[0], unfused[0], rtol=0, atol=1e-12)
    for got, ref in zip(fused[1], unfused[1]):
        for g, r in zip(got, ref, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert max((g[0] - n[0]).abs().max() for g, n in zip(fused[1], none[1])) > 1e-6
    pe_fused, pe_ref = fused[2], unfused[2]
    for k in range(len(pairs)):
        for part in (0, 1) if trainable == "both" else (0,):
            torch.testing.assert_close(pe_fused.lora[k][part], pe_ref.lora[k][part], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(pe_fused.lora[k][0].sum(0), fused[1][k][0], rtol=1e-10, atol=1e-12)
        if trainable == "both":
            torch.testing.assert_close(pe_fused.lora[k][1].sum(0), fused[1][k][1].T, rtol=1e-10, atol=1e-12)


def test_no_compensation_without_dropout():
    """Dropout 0: the base holds W0 - Z0 and the LoRA modules stay plain."""
    model = tiny_bert_cls(dropout=0.0)
    pairs = find_lora_pairs(model)
    W0 = _base_weights(pairs)
    start = move_to_rank_r_start(pairs)
    assert not start.dropout_compensation.active
    for pair, w, (a0, b0) in zip(pairs, W0, start.factors):
        assert type(pair.lora_A) is torch.nn.Linear and type(pair.lora_B) is torch.nn.Linear
        torch.testing.assert_close(pair.layer.get_base_layer().weight, w - a0 @ b0.T, rtol=0, atol=1e-6)


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


def test_started_branch_computes_in_float32_under_bf16_autocast():
    """The HF Trainer's ``bf16=True`` runs the forward under ``torch.autocast``: the started pairs' branch (LoRA
    dropout 0.5) still computes in its float32 factors (its backward, which autocast does not reach, used to mix bf16
    and float32), and the per-example gradients stay float32 and near the float32 run's."""
    from prismdp.grad_sample import GradSampler
    from prismdp.losses import classification_losses

    model = tiny_bert_cls(seed=2, dropout=0.5).train()
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    _move_factors(pairs)
    sampler = GradSampler(model, pairs)
    ids, mask = padded_batch([7, 4, 9])
    got = []
    for autocast in (False, True):
        torch.manual_seed(5)
        with sampler.record() as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # the forward only, as the Trainer
                logits = model(input_ids=ids, attention_mask=mask).logits
            classification_losses(logits.float(), torch.tensor([0, 1, 1])).sum().backward()
        model.zero_grad(set_to_none=True)
        got.append(torch.cat([t.flatten(1) for pair in sampler.grads(rec).lora for t in pair], 1))
    assert got[1].dtype == torch.float32
    err = (got[1] - got[0]).norm(dim=1) / got[0].norm(dim=1)
    assert float(err.max()) < 0.05, err
