"""Privacy-critical behaviour of the PRISM and DP-AdamW mechanisms (the classic DP-SGD bugs)."""

import math

import pytest
import torch

from helpers import gauge_transform, mechanism, method_setup, net_batch, per_example, tiny_net, train_steps
from prismdp import geometry
from prismdp.engine import METHODS
from prismdp.grad_sample import GradSampler
from prismdp.lora import find_lora_pairs, get_factors, move_to_rank_r_start, set_factors
from prismdp.losses import classification_losses
from prismdp.optim import PRISM, dp_adamw

C = 0.5


def setup_prism(sigma=0.0, b=4.0, seed=0, dtype=torch.float32, noise_seed=1, head=True, gauge_seed=None, **kw):
    model = tiny_net(seed=seed, dtype=dtype, head=head)
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    if gauge_seed is not None:
        gauge_transform(pairs, gauge_seed)
    sampler = GradSampler(model, pairs)
    opt = PRISM(pairs, lr=0.05, dense_params=sampler.dense_params, mechanism=mechanism(sigma, C, b, noise_seed), **kw)
    return model, pairs, sampler, opt


def release_norm(opt, release):
    """Global intrinsic norm of a release (all modules + dense), times the expected batch size: the sum."""
    lora, dense = release
    sq = sum(geometry.tangent_norm_sq(*get_factors(opt.pairs[k]), dA, dB) for k, (dA, dB) in enumerate(lora))
    sq = sq + sum(d.square().sum() for d in dense)
    return float(sq.sqrt()) * opt.mechanism.expected_batch_size


def clean_release(opt, grads_list):
    opt.mechanism.reset()
    for g in grads_list:
        opt.accumulate(g)
    return opt.private_release()


def test_each_clipped_example_has_norm_at_most_C():
    model, pairs, sampler, opt = setup_prism()
    x, y = net_batch(6, seed=3)
    x[2] *= 1e4  # an adversarial example with a huge gradient
    norms = []
    for i in range(6):
        g = per_example(model, sampler, x[i : i + 1], y[i : i + 1])
        norms.append(release_norm(opt, clean_release(opt, [g])))
    assert max(norms) <= C * (1 + 1e-5)
    assert norms[2] == pytest.approx(C, rel=1e-4)  # the adversarial one is clipped exactly to C


@pytest.mark.parametrize("method", sorted(METHODS))
def test_add_or_remove_one_example_moves_the_sum_by_at_most_C(method):
    """Sensitivity of every method: the clipped sum (PRISM: in the intrinsic tangent norm of its release) of a batch
    with and without any one example (one of them adversarial) differ by at most C."""
    x, y = net_batch(8, seed=4)
    x[5] *= 1e5  # adversarial
    dists = []
    for drop in range(8):
        keep = [i for i in range(8) if i != drop]
        if method == "prism":
            model, pairs, sampler, opt = setup_prism()
            full = clean_release(opt, [per_example(model, sampler, x, y)])
            part = clean_release(opt, [per_example(model, sampler, x[keep], y[keep])])
            diff = ([(a - c, b_ - d) for (a, b_), (c, d) in zip(full[0], part[0])],
                    [u - v for u, v in zip(full[1], part[1])])
            dist = release_norm(opt, diff)
        else:
            model, pairs, sampler, opt = method_setup(method, sigma=0.0, b=1.0, clip=C)
            sums = []
            for idx in (list(range(8)), keep):
                opt.accumulate(per_example(model, sampler, x[idx], y[idx]))
                sums.append(opt.mechanism.release(opt.coords).values)  # b = 1: the clipped sums
            dist = math.sqrt(sum(float((a - b_).square().sum()) for a, b_ in zip(*sums)))
        dists.append(dist)
    assert max(dists) <= C * (1 + 1e-5), dists
    assert dists[5] == pytest.approx(C, rel=1e-4)  # the adversarial example, clipped: the bound is attained


@pytest.mark.parametrize("examples", [0, 6])
def test_released_noise_has_std_sigma_C_over_expected_batch(examples):
    """PRISM's release minus its clean part (the same clipped examples released by a sigma = 0 twin at the same point)
    is tangent noise of energy (sigma C / b)^2 chi-square(r (m + n - r)), and N(0, (sigma C / b)^2) on the dense
    parameters: for an empty Poisson batch and for a batch of 6 examples in two micro-batches (one clipped), where
    the noise must not depend on the realised batch (a release normalised by it would be off by b / 6)."""
    sigma, b = 2.0, 8.0
    model, pairs, sampler, opt = setup_prism(sigma=sigma, b=b)
    _, _, _, clean_opt = setup_prism(sigma=0.0, b=b)  # the same model, start and point
    tau = sigma * C / b
    x, y = net_batch(6, seed=3)
    x[1] *= 100  # clipped
    grads = [per_example(model, sampler, x[:3], y[:3]), per_example(model, sampler, x[3:], y[3:])][: examples // 3]
    clean = clean_release(clean_opt, grads)
    if examples:
        assert release_norm(clean_opt, clean) > C  # a real signal (the clipped sum of six examples)
    draws = 400
    energy = {k: [] for k in range(len(pairs))}
    dense_vals = []
    for _ in range(draws):
        lora, dense = clean_release(opt, grads)
        for k, ((dA, dB), (cA, cB)) in enumerate(zip(lora, clean[0])):
            energy[k].append(float(geometry.tangent_norm_sq(*get_factors(pairs[k]), dA - cA, dB - cB)))
        dense_vals.append(torch.cat([(d - c).flatten() for d, c in zip(dense, clean[1])]))
    for k, pair in enumerate(pairs):
        m, n, r = pair.shape
        e = torch.tensor(energy[k]) / tau**2  # chi-square with r (m + n - r) degrees of freedom
        se = e.std() / math.sqrt(draws)
        assert abs(e.mean() - r * (m + n - r)) < 5 * se
    d = torch.stack(dense_vals)
    assert d.std().item() == pytest.approx(tau, rel=0.05)
    assert abs(d.mean().item()) < 5 * tau / math.sqrt(d.numel())


@pytest.mark.parametrize("method", sorted(METHODS))
def test_micro_batches_equal_one_large_batch(method):
    """Every method: one logical batch split into micro-batches in any way gives the same noisy step."""
    x, y = net_batch(8, seed=5)
    x[1] *= 50
    results = []
    for chunks in ([8], [2, 2, 2, 2], [3, 5]):
        model, pairs, sampler, opt = method_setup(method, sigma=1.0, clip=C, noise_seed=7)
        start = 0
        for c in chunks:
            opt.accumulate(per_example(model, sampler, x[start : start + c], y[start : start + c]))
            start += c
        opt.step()
        results.append([pair.layer.get_delta_weight("default").detach().clone() for pair in pairs]
                       + [q.detach().clone() for q in sampler.dense_params])
        assert opt.last_stats["batch_size"] == 8 and opt.last_stats["clip_fraction"] > 0
    for other in results[1:]:
        for u, v in zip(results[0], other):
            torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-6)


def test_empty_poisson_batch_steps_with_noise_only():
    model, pairs, sampler, opt = setup_prism(sigma=1.0)
    A0, B0 = get_factors(pairs[0], torch.float64)
    opt.step()  # nothing accumulated
    A1, B1 = get_factors(pairs[0], torch.float64)
    assert opt.last_stats["batch_size"] == 0
    assert torch.isfinite(A1).all() and not torch.allclose(A0 @ B0.T, A1 @ B1.T)


def test_seeded_runs_are_reproducible_and_seeds_matter():
    x, y = net_batch(4, seed=6)
    outs = []
    for noise_seed in (3, 3, 4):
        model, pairs, sampler, opt = setup_prism(sigma=1.0, noise_seed=noise_seed)
        for _ in range(3):
            opt.accumulate(per_example(model, sampler, x, y))
            opt.step()
        outs.append(torch.cat([p.detach().flatten() for pair in pairs for p in pair.params]))
    assert torch.equal(outs[0], outs[1])
    assert not torch.allclose(outs[0], outs[2])


def test_nonfinite_example_contributes_zero_and_is_counted():
    model, pairs, sampler, opt = setup_prism()
    x, y = net_batch(5, seed=8)
    bad = x.clone()
    bad[3, 0, 0] = float("nan")
    ref = clean_release(opt, [per_example(model, sampler, x[[0, 1, 2, 4]], y[[0, 1, 2, 4]])])
    got = clean_release(opt, [per_example(model, sampler, bad, y)])
    assert opt.last_clip.as_dict()["nonfinite"] == 1
    for (a, b_), (c, d) in zip(ref[0], got[0]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(b_, d, rtol=1e-5, atol=1e-7)


class _Refusing:
    def __init__(self):
        self.recorded = 0

    def check_step(self, n=1):
        raise RuntimeError("budget exhausted")

    def record_step(self, n=1):
        self.recorded += n


@pytest.mark.parametrize("method", sorted(METHODS))
def test_budget_refusal_happens_before_noise_or_update(method):
    model, pairs, sampler, opt = method_setup(method, sigma=1.0, clip=C)
    opt.mechanism.budget = _Refusing()
    x, y = net_batch(4)
    opt.accumulate(per_example(model, sampler, x, y))
    before = [p.detach().clone() for p in model.parameters()]
    gen_state = opt.mechanism.generator.get_state()
    with pytest.raises(RuntimeError, match="budget exhausted"):
        opt.step()
    assert torch.equal(opt.mechanism.generator.get_state(), gen_state)  # no noise drawn
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # nothing released into the gradients either
    assert opt.mechanism.budget.recorded == 0


def test_gauge_invariant_trajectory_without_noise():
    """From (A, B) and (A R, B R^-T) with clipping active, 20 steps give the same Z (float64)."""
    x, y = net_batch(6, seed=9, dtype=torch.float64)
    trajectories = []
    for gauge in (False, True):
        model = tiny_net(dtype=torch.float64, head=False)
        pairs = find_lora_pairs(model)
        move_to_rank_r_start(pairs)
        if gauge:
            gauge_transform(pairs, seed=11)
        sampler = GradSampler(model, pairs)
        opt = PRISM(pairs, lr=0.05, mechanism=mechanism(0.0, 0.05, 6.0))
        traj, clipped = [], []
        for _ in range(20):
            opt.accumulate(per_example(model, sampler, x, y))
            opt.step()
            traj.append([pair.layer.get_delta_weight("default").clone() for pair in pairs])
            clipped.append(opt.last_stats["clip_fraction"])
        assert min(clipped[:5]) > 0  # clipping is active
        trajectories.append(traj)
    moved = (trajectories[0][-1][0] - trajectories[0][0][0]).norm()
    assert moved > 1e-3
    for za, zb in zip(*trajectories):
        for u, v in zip(za, zb):
            torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-11)


def test_gauge_invariant_law_with_noise():
    """The law of ||Z_1 - Z_0|| after one noisy step does not depend on the gauge (two-sample test)."""
    x, y = net_batch(4, seed=10)
    samples = {False: [], True: []}
    for gauge in (False, True):
        model, pairs, sampler, opt = setup_prism(sigma=1.0, head=False, gauge_seed=12 if gauge else None)
        z0 = [pair.layer.get_delta_weight("default").detach().clone() for pair in pairs]
        state = [get_factors(p, torch.float32) for p in pairs]
        g = per_example(model, sampler, x, y)
        for seed in range(300):
            for p, (A, B) in zip(pairs, state):
                set_factors(p, A, B)
            opt.state.clear()
            opt.mechanism.generator.manual_seed(seed)
            opt.accumulate(g)
            opt.step()
            dz = sum(float((p.layer.get_delta_weight("default").detach() - z).square().sum()) for p, z in zip(pairs, z0))
            samples[gauge].append(math.sqrt(dz))
    a, b_ = torch.tensor(samples[False]), torch.tensor(samples[True])
    se = math.sqrt(a.var() / len(a) + b_.var() / len(b_))
    assert abs(a.mean() - b_.mean()) < 5 * se
    assert a.std().item() == pytest.approx(b_.std().item(), rel=0.25)


def test_dp_adamw_matches_opacus_clipping_and_noise():
    from opacus.grad_sample import GradSampleModule
    from opacus.optimizers import DPOptimizer

    x, y = net_batch(6, seed=13)
    x[0] *= 30
    b = 5.0

    def ours(sigma, seed):
        model = tiny_net(seed=1)
        pairs = find_lora_pairs(model)
        sampler = GradSampler(model, pairs)
        opt = dp_adamw(pairs, sampler.dense_params, lr=1e-2, mechanism=mechanism(sigma, C, b, seed))
        opt.accumulate(per_example(model, sampler, x, y))
        opt.step()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, model

    def opacus(sigma, seed=0):
        model = tiny_net(seed=1)  # (re-seeds the global generator, which Opacus draws its noise from)
        torch.manual_seed(1000 + seed)
        gsm = GradSampleModule(model, loss_reduction="mean")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = DPOptimizer(torch.optim.AdamW(params, lr=1e-2), noise_multiplier=sigma, max_grad_norm=C,
                          expected_batch_size=int(b), loss_reduction="mean")
        classification_losses(gsm(x), y).mean().backward()
        opt.step()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, model

    g_ours, m_ours = ours(0.0, 0)
    g_opacus, m_opacus = opacus(0.0)
    assert g_ours.keys() == g_opacus.keys()
    for n in g_ours:
        torch.testing.assert_close(g_ours[n], g_opacus[n], rtol=1e-4, atol=1e-7)
    # (parameters are not compared: Adam's first step g / (|g| + eps) amplifies float noise in tiny coordinates)
    # same noise law: (noisy - clean) gradients have per-coordinate std sigma C / b in both
    sigma = 3.0
    noise_ours = torch.cat([(ours(sigma, s)[0][n] - g_ours[n]).flatten() for s in range(20) for n in g_ours])
    noise_opacus = torch.cat([(opacus(sigma, s)[0][n] - g_opacus[n]).flatten() for s in range(20) for n in g_ours])
    assert noise_ours.std().item() == pytest.approx(sigma * C / b, rel=0.05)
    assert noise_opacus.std().item() == pytest.approx(sigma * C / b, rel=0.05)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_exhausted_budget_is_refused_before_noise(method):
    from prismdp.privacy import BudgetExhaustedError, PrivacyBudget

    budget = PrivacyBudget(1.0, 0.1, 1e-5, target_epsilon=1.0)
    budget.record_step(budget.steps_allowed)  # everything spent
    model, pairs, sampler, opt = method_setup(method, sigma=1.0, clip=C, budget=budget)
    x, y = net_batch(4)
    opt.accumulate(per_example(model, sampler, x, y))
    before = [p.detach().clone() for p in model.parameters()]
    gen_state = opt.mechanism.generator.get_state()
    with pytest.raises(BudgetExhaustedError, match="privacy budget exhausted"):
        opt.step()
    assert torch.equal(opt.mechanism.generator.get_state(), gen_state)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert budget.steps_taken == budget.steps_allowed


@pytest.mark.parametrize("method", sorted(METHODS))
def test_private_step_with_infinite_clip_and_no_noise_is_the_nonprivate_step(method):
    """Opacus' compare-to-vanilla, for every method: with C = inf (no clipping) and sigma = 0 and a batch of exactly
    the expected size, three private steps (per-example gradients, summed, divided by b) give the trajectory of the
    non-private optimizer on the mean loss (float64)."""
    x, y = net_batch(8, seed=6, dtype=torch.float64)
    x[2] *= 30  # a large gradient: would be clipped at any finite C
    finals = []
    for private in (True, False):
        model, pairs, sampler, opt = method_setup(method, sigma=0.0, b=8.0, clip=math.inf, private=private, lr=0.02,
                                                  dtype=torch.float64)
        start = [p.detach().clone() for p in model.parameters()]
        train_steps(model, sampler, opt, x, y, 3, private)
        finals.append([p.detach().clone() for p in model.parameters()])
        if private:
            assert opt.last_stats["clip_fraction"] == 0.0
    assert max(float((a - b_).abs().max()) for a, b_ in zip(finals[1], start)) > 1e-3  # the steps moved it
    for a, b_ in zip(*finals):
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dp", [True, False])
def test_batching_modules_by_shape_does_not_change_the_math(dp):
    """tiny_net has two LoRA modules of one shape: stacked as one group they follow exactly the trajectory they
    follow one by one (private with clipping active and no noise, and non-private)."""
    finals = []
    for stacked in (True, False):
        opt, _, final = _six_prism_steps(dp, stack_by_shape=stacked)
        assert [len(idx) for idx in opt.stacks] == ([1, 2] if stacked else [1, 1, 1])
        finals.append(final)
    for a, b in zip(*finals):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _six_prism_steps(dp: bool, **options) -> tuple[PRISM, list[torch.Tensor], list[torch.Tensor]]:
    """Six PRISM steps of tiny_net (float64) on one batch, private with clipping active and no noise or non-private;
    returns the optimizer and the trainable parameters before and after the steps."""
    x, y = net_batch(6, seed=4, dtype=torch.float64)
    model = tiny_net(dtype=torch.float64, seed=2)
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    opt = PRISM(pairs, lr=0.05, dense_params=sampler.dense_params, mechanism=mechanism(0.0, 0.05, 6.0) if dp else None,
                **options)
    start = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    train_steps(model, sampler, opt, x, y, 6, dp)
    return opt, start, [p.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("dp", [True, False])
def test_the_thin_qr_does_not_change_the_math(dp, monkeypatch):
    """PRISM's ``qr`` option (CholeskyQR, the CUDA default, against Householder, the CPU default): six steps follow
    the same trajectory (float64; private with clipping active and no noise, whose draws are the same only in law:
    the two R factors differ in sign), and CholeskyQR is what the frames and the retraction then call."""
    from prismdp import geometry

    calls = []
    real = geometry.cholesky_qr
    monkeypatch.setattr(geometry, "cholesky_qr", lambda X: calls.append(X.shape) or real(X))
    finals = []
    for qr in ("householder", "cholesky"):
        calls.clear()
        opt, start, final = _six_prism_steps(dp, qr=qr)
        assert len(calls) == (0 if qr == "householder" else 6 * 4 * len(opt.stacks))  # frame + retraction, A and B
        finals.append(final)
    assert max(float((a - b).abs().max()) for a, b in zip(finals[0], start)) > 1e-3  # the steps moved it
    for a, b in zip(*finals):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="qr must be one of"):
        PRISM(opt.pairs, lr=0.05, qr="cholesky-qr")


def test_privacy_json_names_the_torch_generator_of_the_device_that_draws_the_noise():
    """Issue 30: on CUDA privacy.json said "Mersenne Twister on the CPU" while torch's CUDA generator is Philox,
    drawing on the GPU.  The name follows the generator's device; make_private builds the generator on the
    parameters' device and privacy.json names that one."""
    from prismdp.engine import make_private
    from prismdp.privacy.secure import SEEDED_NOISE, describe_torch_generator

    cuda, cpu = describe_torch_generator("cuda:0"), describe_torch_generator(torch.device("cpu"))
    assert "Philox" in cuda and "on the GPU" in cuda and "Mersenne" not in cuda
    assert "Mersenne Twister" in cpu and "on the CPU" in cpu
    model = tiny_net()
    private = make_private(model, method="dp-adamw", lr=1e-3, dataset_size=100, batch_size=10, steps=3,
                           noise_multiplier=1.0, seed=5)
    device = private.pairs[0].lora_A.weight.device
    assert private.mechanism.generator.device == device
    source = private.privacy_report()["noise_source"]
    assert source == {"generator": describe_torch_generator(device), "gaussian": "torch.randn",
                      "drawn_on": str(device), "seed": SEEDED_NOISE}


def test_privacy_json_says_a_seeded_runs_noise_is_reproducible_from_its_seed():
    """The default noise is torch's generator seeded with the run's seed, which config.json records (the CLI's
    default is 42): whoever knows it regenerates the noise, so the guarantee then holds only against an adversary
    who does not know it.  privacy.json says so for a seeded run, and names OS entropy for an unseeded one; the
    seeded run's noise is the one torch.randn draws from a generator seeded with that seed (what an adversary would
    do), the unseeded run's is not."""
    from prismdp.engine import make_private
    from prismdp.privacy.secure import SEEDED_NOISE

    def run(seed):
        private = make_private(tiny_net(), method="dp-adamw", lr=1e-3, dataset_size=100, batch_size=10, steps=3,
                               noise_multiplier=1.0, seed=seed)
        source = private.privacy_report()["noise_source"]
        return source, private.mechanism.noise_source.normal((4, 3), torch.float32, "cpu")

    adversary = torch.randn((4, 3), generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    (seeded, noise), (unseeded, fresh) = run(5), run(None)
    assert seeded["seed"] == SEEDED_NOISE and "config.json" in seeded["seed"] and "--secure-noise" in seeded["seed"]
    assert torch.equal(noise, adversary)
    assert unseeded["seed"].startswith("OS entropy") and not torch.equal(fresh, adversary)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_noise_is_drawn_on_the_device_by_its_seeded_generator(device):
    """The release's noise is sigma C times torch.randn from a generator of that device seeded with the run's seed
    (drawn there, in release order): the seeded reference, reproducible from the seed alone."""
    from prismdp.privacy.clipping import DPConfig, noise_generator
    from prismdp.privacy.mechanism import Euclidean, GaussianMechanism

    shapes = [torch.Size([3, 4]), torch.Size([5])]
    dev = torch.device(device)
    mech = GaussianMechanism(DPConfig(2.0, 0.5, 4.0), generator=noise_generator(dev, seed=11), device=dev)
    release = mech.release(Euclidean(shapes, torch.float32, [dev, dev]))
    ref = torch.Generator(device=dev).manual_seed(11)
    expected = [1.0 * torch.randn(s, generator=ref, device=dev) for s in shapes]  # sigma C = 1
    for got, want in zip(release.noise, expected, strict=True):
        assert got.device.type == dev.type
        assert torch.equal(got, want)
    for got, want in zip(release.values, expected, strict=True):
        assert torch.allclose(got, want / 4.0)


def test_clipping_counters_stay_on_the_device_across_batches():
    """The clipping statistics live on the coefficients' device: after a batch is taken, the next batch's zeroed
    counters are made there (a fill), not on the CPU and copied over each step (issue 44: five host-to-device copies
    per step).  The meta device stands in for a GPU: a counter made on the CPU would show as such."""
    from prismdp.privacy.clipping import ClippedSum

    clip = ClippedSum(1.0)
    for _ in range(3):
        clip.coefficients(torch.rand(4, device="meta"))
        taken = clip.take()
        assert {t.device.type for t in (taken.examples, taken.clipped, taken.coef_sum)} == {"meta"}
        assert {getattr(clip, n).device.type for n in ("examples", "clipped", "coef_sum", "nonfinite",
                                                       "norm_sum")} == {"meta"}
    cpu = ClippedSum(1.0)  # and the values on the CPU: 2 of 3 clipped, one not finite
    cpu.coefficients(torch.tensor([4.0, 0.25, float("inf")]))
    cpu.coefficients(torch.tensor([9.0]))
    got = cpu.take()
    assert [float(v) for v in (got.examples, got.clipped, got.nonfinite)] == [4.0, 2.0, 1.0]
    assert float(got.coef_sum) == pytest.approx(0.5 + 1.0 + 0.0 + 1 / 3)
    assert float(got.norm_sum) == pytest.approx(2.0 + 0.5 + 0.0 + 3.0)
    assert float(cpu.examples) == 0.0 and cpu.examples.device.type == "cpu"
