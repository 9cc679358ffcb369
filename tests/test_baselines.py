"""The paper's baselines (FFA-LoRA, LoRA+, LAMB, LoRA-RITE, and DP-AdamW) under the same DP machinery."""

import math

import pytest
import torch

from helpers import gauge_transform, mechanism, method_setup, net_batch, per_example, randomise_lora_B, tiny_net
from prismdp.engine import METHODS, make_private
from prismdp.grad_sample import GradSampler
from prismdp.lora import LoraSetupError, find_lora_pairs, move_to_rank_r_start
from prismdp.losses import classification_losses
from prismdp.optim import DPFactorOptimizer, Lamb, dp_adamw, dp_ffa, dp_lora_plus, dp_lora_rite

C = 0.5
BASELINES = ["dp-adamw", "ffa", "lora-plus", "lamb", "lora-rite"]


def rule_task(N=256, seed=0):
    """A learnable 3-class rule on tiny_net inputs: the argmax of a fixed linear map of the token mean."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 5, 10, generator=g)
    return x, (x.mean(1) @ torch.randn(10, 3, generator=g)).argmax(1)


def private_setup(method, sigma=0.0, b=4.0, noise_seed=1, clip=C):
    """The method's optimizer exactly as make_private builds it (prepare, pair discovery, builder)."""
    model = tiny_net(seed=1)
    randomise_lora_B(model)
    spec = METHODS[method]
    if spec.prepare is not None:
        spec.prepare(model, "default")
    pairs = find_lora_pairs(model, trainable=spec.trainable)
    sampler = GradSampler(model, pairs)
    opt = spec.build(pairs, sampler.dense_params, lr=1e-2, mechanism=mechanism(sigma, clip, b, noise_seed))
    assert isinstance(opt, DPFactorOptimizer)
    return model, pairs, sampler, opt


def delta_weights(pairs):
    return torch.cat([pair.layer.get_delta_weight("default").detach().flatten() for pair in pairs])


# ------------------------------------------------------------------------------------------ every method


@pytest.mark.parametrize("method,lr", [("dp-adamw", 1e-2), ("ffa", 3e-2), ("lora-plus", 1e-2), ("lamb", 5e-2),
                                       ("lora-rite", 1e-2)])
def test_nonprivate_variant_learns_a_rule(method, lr):
    x, y = rule_task()
    model = tiny_net(seed=0)
    run = make_private(model, method=method, lr=lr, dataset_size=len(x), batch_size=64, steps=40, seed=0)
    assert not run.private and not isinstance(run.optimizer, DPFactorOptimizer)
    z0 = delta_weights(run.pairs)
    with torch.no_grad():
        before = classification_losses(model(x), y).mean().item()
    for batch in run.batches():
        run.backward(classification_losses(model(x[batch]), y[batch]))
        run.step()
    with torch.no_grad():
        after = classification_losses(model(x), y).mean().item()
    assert after < 0.75 * before, (before, after)
    assert torch.isfinite(delta_weights(run.pairs)).all()
    assert (delta_weights(run.pairs) - z0).norm() > 1e-2  # the LoRA update itself moved


@pytest.mark.parametrize("method", BASELINES)
def test_private_clip_is_per_example_global_L2_on_the_trained_tensors(method):
    """Each example's sum contribution is min(1, C / ||g_i||) g_i, g_i = autograd gradient of exactly the trained
    tensors (FFA: lora_B and dense, never the frozen lora_A); hence its norm is <= C (= C when clipped)."""
    x, y = net_batch(4, seed=3)

    def autograd_grads(model, trained, i):
        classification_losses(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        ref = [p.grad.detach().clone() for p in trained]
        model.zero_grad(set_to_none=True)
        return ref, math.sqrt(sum(float(g.square().sum()) for g in ref))

    model, _, _, opt = private_setup(method)
    norms = sorted(autograd_grads(model, opt.params, i)[1] for i in range(4))
    clip = 0.5 * (norms[1] + norms[2])  # between the norms: some examples are clipped, some are not
    model, pairs, sampler, opt = private_setup(method, clip=clip)
    trained = opt.params
    assert len(trained) == len(sampler.dense_params) + len(pairs) * (1 if method == "ffa" else 2)
    clipped = []
    for i in range(4):
        ref, ref_norm = autograd_grads(model, trained, i)
        opt.mechanism.reset()
        opt.accumulate(per_example(model, sampler, x[i : i + 1], y[i : i + 1]))
        coef = min(1.0, clip / ref_norm)
        for s, g in zip(opt.mechanism.sums, ref):
            torch.testing.assert_close(s, coef * g, rtol=1e-4, atol=1e-7)
        norm = math.sqrt(sum(float(s.square().sum()) for s in opt.mechanism.sums))
        assert norm <= clip * (1 + 1e-5)
        clipped.append(coef < 1)
    assert any(clipped) and not all(clipped)


@pytest.mark.parametrize("examples", [0, 6])
@pytest.mark.parametrize("method", BASELINES)
def test_private_noise_has_std_sigma_C_over_b_on_every_trained_coordinate(method, examples):
    """The released gradient (what the optimizer's step receives in p.grad) minus the release of the same clipped
    examples by a sigma = 0 twin: N(0, (sigma C / b)^2) on every trained coordinate, for an empty Poisson batch and
    for 6 examples in two micro-batches (one clipped): noise normalised by the realised batch would be off by b / 6.
    The per-example gradients are computed once, so the moving point does not change the clean part."""
    sigma, b, draws = 2.0, 8.0, 200
    model, pairs, sampler, opt = method_setup(method, sigma=sigma, b=b, clip=C, lr=1e-2)
    _, _, _, clean_opt = method_setup(method, sigma=0.0, b=b, clip=C, lr=1e-2)
    tau = sigma * C / b
    trained, clean_trained = opt.params, clean_opt.params
    x, y = net_batch(6, seed=3)
    x[1] *= 100  # clipped
    micro = [per_example(model, sampler, x[:3], y[:3]), per_example(model, sampler, x[3:], y[3:])][: examples // 3]

    def released(o, params):
        for g in micro:
            o.accumulate(g)
        o.step()
        return torch.cat([p.grad.flatten() for p in params])

    clean = released(clean_opt, clean_trained)
    assert (clean.norm() > 0.1) == (examples > 0)
    grads = []
    for _ in range(draws):
        grads.append(released(opt, trained) - clean)
    if examples:
        assert opt.last_stats["batch_size"] == 6 and opt.last_stats["clip_fraction"] > 0
    g = torch.stack(grads)
    assert g.std().item() == pytest.approx(tau, rel=0.03)
    assert abs(g.mean().item()) < 5 * tau / math.sqrt(g.numel())
    per_coord = g.std(0) / tau
    assert per_coord.min() > 0.75 and per_coord.max() < 1.25  # every coordinate is noised, at the same scale
    if method == "ffa":
        assert all(pair.lora_A.weight.grad is None for pair in pairs)  # the frozen factor gets no noise


def test_epsilon_is_identical_across_all_methods():
    x, y = rule_task(N=200)
    reports = {}
    for method in sorted(METHODS):
        model = tiny_net(seed=0)
        run = make_private(model, method=method, lr=1e-3, dataset_size=200, batch_size=20, steps=4,
                           target_epsilon=3.0, delta=1e-5, max_grad_norm=C, seed=0)
        for batch in run.batches():
            run.backward(classification_losses(model(x[batch]), y[batch]))
            run.step()
        rep = run.privacy_report()
        assert rep["method"] == method and rep["epsilon"] == run.epsilon
        reports[method] = {k: v for k, v in rep.items() if k != "method"}
    assert set(reports) >= set(BASELINES) | {"prism"}
    first = reports["prism"]
    assert first["steps"] == 4 and 0 < first["epsilon"] <= 3.0
    for method, rep in reports.items():
        assert rep == first, method


def test_every_built_in_method_has_its_label_and_default_rates():
    from prismdp.data.tasks import FAMILIES

    builtin = ("prism", "dp-adamw", "ffa", "lora-plus", "lamb", "lora-rite")
    for method in builtin:
        assert set(METHODS[method].lr) == set(FAMILIES), method
    assert all(METHODS["lamb"].lr[f] == 5e-3 for f in FAMILIES)
    for family, rate in (("glue", 2e-4), ("math", 3e-4)):  # the paper's Appendix B
        assert all(METHODS[m].lr[family] == rate for m in builtin if m != "lamb"), family
    assert METHODS["prism"].lr["demo"] == 1e-2 and METHODS["dp-adamw"].lr["demo"] == 2e-3
    # the paper's Table 2 spelling
    assert [METHODS[m].label for m in builtin] == ["PRISM", "AdamW", "FFA", "LoRA+", "LAMB", "RITE"]
    with pytest.raises(ValueError, match="already registered"):
        from prismdp.engine import register_method

        register_method("prism", METHODS["prism"].build)


# ------------------------------------------------------------------------------------------ FFA-LoRA


def test_ffa_trains_B_only_and_never_moves_A():
    x, y = rule_task(N=128)
    for noise in (None, 1.0):
        model = tiny_net(seed=0)
        run = make_private(model, method="ffa", lr=1e-2, dataset_size=128, batch_size=32, steps=6,
                           noise_multiplier=noise, max_grad_norm=C, seed=0)
        A0 = [pair.lora_A.weight.detach().clone() for pair in run.pairs]
        B0 = [pair.lora_B.weight.detach().clone() for pair in run.pairs]
        assert all(not pair.trains_A and not pair.lora_A.weight.requires_grad for pair in run.pairs)
        assert all(a.abs().sum() > 0 for a in A0)  # PEFT's random init, kept
        for batch in run.batches():
            run.backward(classification_losses(model(x[batch]), y[batch]))
            run.step()
        for pair, a0, b0 in zip(run.pairs, A0, B0):
            assert torch.equal(pair.lora_A.weight, a0)
            assert not torch.equal(pair.lora_B.weight, b0)


def test_frozen_A_pairs_need_frozen_A_and_carry_no_A_gradient():
    model = tiny_net()
    with pytest.raises(LoraSetupError, match="freeze_lora_A"):
        find_lora_pairs(model, trainable="B")
    with pytest.raises(ValueError, match="frozen lora_A|trainable lora_A"):
        dp_ffa(find_lora_pairs(model), mechanism=None)
    METHODS["ffa"].prepare(model, "default")
    with pytest.raises(LoraSetupError, match="no trainable"):
        find_lora_pairs(model, trainable="both")  # no pair has two trainable factors any more
    pairs = find_lora_pairs(model, trainable="B")
    assert [p.trained_params for p in pairs] == [(p.lora_B.weight,) for p in pairs]
    sampler = GradSampler(model, pairs)
    x, y = net_batch(3)
    grads = per_example(model, sampler, x, y)
    assert all(g_wa is None and g_wb.shape[0] == 3 for g_wb, g_wa in grads.lora)
    with pytest.raises(ValueError, match="frozen lora_A"):
        dp_lora_rite(pairs, mechanism=None)


# ------------------------------------------------------------------------------------------ LoRA+


def test_lora_plus_lr_ratio_in_groups_and_in_the_first_step():
    lr, ratio = 1e-3, 6.0
    model = tiny_net(seed=2)
    randomise_lora_B(model)
    pairs = find_lora_pairs(model)
    sampler = GradSampler(model, pairs)
    opt = dp_lora_plus(pairs, sampler.dense_params, lr=lr, mechanism=None)
    assert {g["name"]: g["lr"] for g in opt.param_groups} == {"lora_A": lr, "lora_B": ratio * lr, "dense": lr}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    x, y = net_batch(8, seed=4)
    classification_losses(model(x), y).mean().backward()
    opt.step()
    step = {n: (p.detach() - before[n]).abs() for n, p in model.named_parameters() if n in before}
    # Adam's first step moves every coordinate by ~lr (g / (|g| + eps)): the realised step sizes show the ratio
    a = torch.cat([s.flatten() for n, s in step.items() if "lora_A" in n]).median().item()
    b = torch.cat([s.flatten() for n, s in step.items() if "lora_B" in n]).median().item()
    d = torch.cat([s.flatten() for n, s in step.items() if "lora" not in n]).median().item()
    assert a == pytest.approx(lr, rel=1e-3) and d == pytest.approx(lr, rel=1e-3)
    assert b == pytest.approx(ratio * lr, rel=1e-3)
    # the kwarg reaches the builder through make_private
    run = make_private(tiny_net(), method="lora-plus", lr=lr, dataset_size=10, batch_size=2, steps=1,
                       loraplus_ratio=4.0)
    assert sorted(g["lr"] for g in run.optimizer.param_groups) == [lr, lr, 4 * lr]


# ------------------------------------------------------------------------------------------ LAMB


def test_lamb_trust_ratio_on_a_hand_computed_case():
    lr, eps, wd = 0.1, 1e-6, 0.01
    f64 = dict(dtype=torch.float64)
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0], **f64))  # ||w|| = 5
    zero = torch.nn.Parameter(torch.zeros(2, **f64))  # ||w|| = 0: trust ratio 1
    decay_only = torch.nn.Parameter(torch.tensor([1.0, 0.0], **f64))  # zero gradient, weight decay only
    idle = torch.nn.Parameter(torch.tensor([1.0, 2.0], **f64))  # zero gradient, no decay: ||u|| = 0, no move
    opt = Lamb([{"params": [w, zero, decay_only]}, {"params": [idle], "weight_decay": 0.0}],
               lr=lr, eps=eps, weight_decay=wd)
    w.grad = torch.tensor([1.0, -2.0], **f64)
    zero.grad = torch.tensor([0.5, 0.25], **f64)
    decay_only.grad = torch.zeros(2, **f64)
    idle.grad = torch.zeros(2, **f64)
    opt.step()
    # first step with bias correction: m_hat = g, v_hat = g^2, so u = g / (|g| + eps) + wd w
    u = torch.tensor([1 / (1 + eps), -2 / (2 + eps)], **f64) + wd * torch.tensor([3.0, 4.0], **f64)
    expected = torch.tensor([3.0, 4.0], **f64) - lr * (5.0 / u.norm()) * u
    torch.testing.assert_close(w.detach(), expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(zero.detach(), -lr * torch.tensor([0.5 / (0.5 + eps), 0.25 / (0.25 + eps)], **f64))
    # u = wd w, trust ratio ||w|| / ||wd w|| = 1 / wd: the step is lr w, whatever wd
    torch.testing.assert_close(decay_only.detach(), torch.tensor([1.0 - lr, 0.0], **f64))
    torch.testing.assert_close(idle.detach(), torch.tensor([1.0, 2.0], **f64))
    assert float(Lamb.trust_ratio(torch.zeros(3), torch.ones(3))) == 1.0
    assert float(Lamb.trust_ratio(torch.ones(4), torch.zeros(4))) == 1.0
    assert float(Lamb.trust_ratio(torch.full((4,), 3.0), torch.ones(4))) == pytest.approx(3.0)


# ------------------------------------------------------------------------------------------ LoRA-RITE




def _z_trajectory(build, gauge, steps=8, **kw):
    x, y = net_batch(16, seed=9, dtype=torch.float64)
    model = tiny_net(dtype=torch.float64, head=False)
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs, init="random", init_scale=0.3, generator=torch.Generator().manual_seed(3))
    if gauge:
        gauge_transform(pairs, seed=11)
    opt = build(pairs, [], lr=0.02, mechanism=None, **kw)
    traj = [delta_weights(pairs)]
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        classification_losses(model(x), y).mean().backward()
        opt.step()
        traj.append(delta_weights(pairs))
    return torch.stack(traj)


@pytest.mark.parametrize("kw", [{}, {"clip_unmagnified_grad": 1e-3, "update_cap": 0.5}])
def test_lora_rite_Z_trajectory_is_invariant_to_the_factorisation(kw):
    plain, gauged = _z_trajectory(dp_lora_rite, False, **kw), _z_trajectory(dp_lora_rite, True, **kw)
    torch.testing.assert_close(plain[0], gauged[0], rtol=1e-12, atol=1e-13)  # the same Z to begin with
    assert (plain[-1] - plain[0]).norm() > 1e-2  # it moved
    torch.testing.assert_close(plain, gauged, rtol=1e-9, atol=1e-11)
    # the test has power: AdamW from the same two factorisations leaves the same Z on different paths
    adam, adam_gauged = _z_trajectory(dp_adamw, False), _z_trajectory(dp_adamw, True)
    assert (adam[-1] - adam_gauged[-1]).norm() > 0.1 * (adam[-1] - adam[0]).norm()


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nonfinite_example_contributes_zero_and_is_counted_factor_space(bad_value):
    """DP-AdamW's clipped sum: an example whose per-example gradient is not finite gets coefficient 0, adds exactly
    nothing (no NaN leaks into the sum) and is counted; the other examples are summed as usual."""
    model, pairs, sampler, opt = private_setup("dp-adamw")
    x, y = net_batch(4, seed=3)
    bad = per_example(model, sampler, x, y)
    bad.lora[0][0][3, 0, 0] = bad_value
    opt.accumulate(bad)
    assert opt.mechanism.clip.stats()["nonfinite"] == 1
    with_bad = [s.clone() for s in opt.mechanism.sums]
    assert all(torch.isfinite(s).all() for s in with_bad)
    opt.mechanism.reset()
    opt.accumulate(per_example(model, sampler, x[:3], y[:3]))  # the three finite examples alone
    for a, b in zip(with_bad, opt.mechanism.sums):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
