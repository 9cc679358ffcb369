"""One batched factorisation per kind for all of PRISM's stacks (issue 44: on CUDA each ``torch.linalg.svd`` /
``eigh`` call reads its status on the host, so a step's synchronisations grew with the number of stacks)."""

import pytest
import torch

from helpers import mechanism, net_batch, tiny_net, train_steps
from prismdp.grad_sample import GradSampler
from prismdp.lora import find_lora_pairs, move_to_rank_r_start
from prismdp.optim import PRISM, factorise


def _sym(*shape, seed):
    X = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return X + X.mT


def test_answer_is_each_request_factorised_alone_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    requests = [("svd", torch.randn(3, 4, 4, generator=g, dtype=torch.float64)),
                ("eigh", _sym(2, 3, 5, 5, seed=1)),
                ("svd", torch.randn(4, 4, generator=g, dtype=torch.float64)),       # same kind and shape: one call
                ("svd", torch.randn(2, 6, 6, generator=g, dtype=torch.float64)),    # another shape: its own call
                ("eigh", _sym(5, 5, seed=2)),
                ("svd", torch.randn(1, 4, 4, generator=g, dtype=torch.float32))]   # another dtype: its own call
    calls = []
    real = {name: getattr(torch.linalg, name) for name in factorise.FACTORISATIONS}
    with pytest.MonkeyPatch.context() as mp:
        for name in real:
            mp.setattr(torch.linalg, name, lambda X, _n=name: calls.append(_n) or real[_n](X))
        answers = factorise.answer(requests)
    assert sorted(calls) == ["eigh", "svd", "svd", "svd"]
    for (name, X), got in zip(requests, answers):
        want = real[name](X)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown factorisation 'qr'"):
        factorise.answer([("qr", requests[0][1])])


def test_run_in_lockstep_answers_every_round_and_returns_in_order():
    def update(k):
        w, _ = yield "eigh", _sym(3, 3, seed=k)
        U, S, Vh = yield "svd", torch.eye(3, dtype=torch.float64) * (k + 1)
        return k, float(w.sum()), float(S.sum())

    def no_request():
        return "done"
        yield  # a generator that returns at once

    results = factorise.run_in_lockstep([update(0), no_request(), update(1)])
    assert results[1] == "done"
    for k in (0, 1):
        i = 2 * k
        assert results[i][0] == k and results[i][2] == pytest.approx(3.0 * (k + 1))
        assert results[i][1] == pytest.approx(float(torch.linalg.eigvalsh(_sym(3, 3, seed=k)).sum()))


def _setup(dtype=torch.float64, **kw):
    model = tiny_net(dtype=dtype, seed=2)
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    opt = PRISM(pairs, lr=0.05, dense_params=sampler.dense_params, mechanism=mechanism(1.0, 0.05, 6.0, seed=3), **kw)
    return model, sampler, opt


@pytest.mark.parametrize("preset, per_step", [("paper", {"eigh": 1, "svd": 2}),
                                              ("reference", {"eigh": 3, "svd": 2})])
@pytest.mark.parametrize("stack_by_shape", [True, False])
def test_a_prism_step_makes_each_factorisation_once_for_all_stacks(preset, per_step, stack_by_shape, monkeypatch):
    """tiny_net: 2 stacks (3 with stack_by_shape=False).  Per step: the preconditioner's eigh, the retraction's SVD
    and the alignment's SVD, each once (the reference preset's horizontal lifts add an eigh before the moments and
    one before the retraction); one call each per stack before."""
    model, sampler, opt = _setup(preset=preset, stack_by_shape=stack_by_shape)
    assert len(opt.stacks) == (2 if stack_by_shape else 3)
    calls = {"svd": 0, "eigh": 0}
    real = {name: getattr(torch.linalg, name) for name in calls}

    def counted(name):
        def call(X, *a, **k):
            calls[name] += 1
            return real[name](X, *a, **k)
        return call

    for name in calls:
        monkeypatch.setattr(torch.linalg, name, counted(name))
    x, y = net_batch(6, seed=4, dtype=torch.float64)
    train_steps(model, sampler, opt, x, y, 3)
    assert calls == {name: 3 * n for name, n in per_step.items()}


def _one_at_a_time(updates):
    """The per-stack order of before: each update runs to its end alone, one call per request."""
    out = []
    for u in updates:
        value = None
        try:
            while True:
                name, X = u.send(value)
                value = tuple(getattr(torch.linalg, name)(X))
        except StopIteration as stop:
            out.append(stop.value)
    return out


@pytest.mark.parametrize("preset", ["paper", "reference"])
@pytest.mark.parametrize("private", [True, False])
def test_the_batched_step_is_the_per_stack_step_bit_for_bit(preset, private, monkeypatch):
    """Six noisy steps (or non-private ones) with the factorisations batched across stacks equal, bit for bit on the
    CPU, the same steps with each stack factorised alone (LAPACK factorises a batch one matrix at a time); a wrong
    split of the batched results (a stack given another's factors) would not."""
    x, y = net_batch(6, seed=4, dtype=torch.float64)
    finals = []
    for run in (factorise.run_in_lockstep, _one_at_a_time):
        monkeypatch.setattr(factorise, "run_in_lockstep", run)
        model, sampler, opt = _setup(preset=preset)
        if not private:
            opt.mechanism = None
        start = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        train_steps(model, sampler, opt, x, y, 6, private)
        finals.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
    assert max(float((a - b).abs().max()) for a, b in zip(finals[0], start)) > 1e-3  # the steps moved it
    for a, b in zip(*finals):
        assert torch.equal(a, b)
