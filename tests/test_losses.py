"""prismdp.losses.causal_lm_losses against the dense formula it replaced (issue 30), and its memory bound."""

from __future__ import annotations

import json
import platform
import warnings
from pathlib import Path

import pytest
import torch

from helpers import run_python
from prismdp import losses
from prismdp.losses import CHUNK_BYTES, causal_lm_losses, fused_usable


def dense_reference(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The formula before issue 30, written out in float64: position t predicts labels[:, t + 1]; a token's loss is
    logsumexp(x) - x[target]; an example's loss is the sum over its target tokens (labels != -100), divided by their
    count clamped at 1 for "mean" (an example without target tokens: 0)."""
    x = logits[:, :-1].double()
    y = labels[:, 1:]
    keep = y != -100
    picked = x.gather(2, y.clamp_min(0).unsqueeze(2)).squeeze(2)
    tok = torch.where(keep, torch.logsumexp(x, dim=2) - picked, torch.zeros_like(picked))
    total = tok.sum(dim=1)
    return total if reduction == "sum" else total / keep.sum(dim=1).clamp_min(1)


def _batch(dtype, b=5, T=11, V=53, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, T, V, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, V, (b, T), generator=g)
    labels[0, :6] = -100  # a prompt
    labels[1, :] = -100  # no target token at all
    labels[2, 1:] = -100  # labels[:, 0] is never a target: no target token either
    labels[3, 7:] = -100  # padding
    labels[4, ::2] = -100  # scattered
    return logits, labels


# (dtype, tolerance on the loss, on the gradient) against the float64 formula evaluated on the same input values:
# float64 is exact to round-off; float32 accumulates in float32 (relative ~1e-7 per op over 53-way sums);
# bfloat16 inputs are upcast exactly and accumulate in float32 too, so the loss is as accurate as float32's, and
# the gradient is rounded to bfloat16 (relative 2^-8).
DTYPES = [(torch.float64, 1e-12, 1e-12), (torch.float32, 2e-6, 1e-6), (torch.bfloat16, 2e-6, 4e-3)]


@pytest.fixture(autouse=True)
def _fresh_compiler_caches():
    # each test compiles the fused kernels afresh: dynamo's recompile limit (8 graphs per function) counts every dtype
    # and chunk shape one process meets, more of them in this file than in any training run
    torch._dynamo.reset()
    losses._FUSED_USABLE.clear()
    yield


@pytest.mark.parametrize("dtype, tol, gtol", DTYPES)
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_values_and_gradients_equal_the_dense_formula(dtype, tol, gtol, gather, chunk, reduction, fused):
    # fused: the torch.compile'd kernels (the CUDA default), compiled here by the CPU backend: the same math
    logits, labels = _batch(dtype)
    x = logits.clone().requires_grad_()
    got = causal_lm_losses(x, labels, reduction, gather=gather, chunk_tokens=chunk, fused=fused)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)  # never bf16 accumulation
    weights = torch.linspace(-1.0, 2.0, len(got), dtype=torch.float64)
    (got.double() * weights).sum().backward()

    ref_x = logits.double().requires_grad_()
    ref = dense_reference(ref_x, labels, reduction)
    (ref * weights).sum().backward()
    torch.testing.assert_close(got.double(), ref.detach(), rtol=tol, atol=tol)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=gtol, atol=gtol)
    assert got[1] == 0 and got[2] == 0  # the examples without a target token: loss 0 ...
    assert not x.grad[1].any() and not x.grad[2].any()  # ... and no gradient, as before
    assert not x.grad[:, -1].any()  # the last position predicts nothing


@pytest.mark.parametrize("gather", [False, True])
def test_a_fully_masked_batch_has_zero_losses_and_zero_gradients(gather):
    logits, _ = _batch(torch.float32)
    x = logits.requires_grad_()
    got = causal_lm_losses(x, torch.full(logits.shape[:2], -100), gather=gather)
    got.sum().backward()
    assert torch.equal(got, torch.zeros(len(got))) and torch.equal(x.grad, torch.zeros_like(x))


def test_float16_and_bfloat16_logits_give_float32_losses_accurate_to_float32():
    # the bf16 path (prismdp train --dtype bfloat16): the loss of bf16 logits is the float32-accurate loss of those
    # bf16 values, not a bf16-rounded one (bf16's relative step is 2^-8 = 4e-3)
    logits, labels = _batch(torch.float32, T=64, V=1000)
    for dtype in (torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        got = causal_lm_losses(x, labels)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), dense_reference(x, labels), rtol=1e-6, atol=1e-6)


def test_matches_torch_cross_entropy_over_the_transposed_logits():
    # an independent implementation: torch's own cross-entropy on the (b, V, T) layout the old code used
    logits, labels = _batch(torch.float64)
    tok = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
    count = (labels[:, 1:] != -100).sum(dim=1).clamp_min(1)
    torch.testing.assert_close(causal_lm_losses(logits, labels), tok.sum(dim=1) / count, rtol=1e-12, atol=1e-12)


def test_a_training_run_compiles_each_fused_kernel_once():
    # the compiled kernels must not recompile per step (seconds each on a GPU): the usability probe and every later
    # call, with micro-batches of different lengths and a partial last chunk, share one graph per kernel
    from torch._dynamo.utils import counters

    counters.clear()
    V = 97
    for step in range(6):
        T = 33 if step % 2 else 29
        logits, labels = _batch(torch.bfloat16, T=T, V=V, seed=step)
        assert fused_usable(logits.reshape(-1, V), torch.float32)
        x = logits.requires_grad_()
        causal_lm_losses(x, labels, fused=True, chunk_tokens=40).sum().backward()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_a_compiler_failure_falls_back_to_the_eager_loss_with_one_warning(monkeypatch):
    def broken(fn):
        raise RuntimeError("no working C++ compiler / Triton here")

    monkeypatch.setattr(losses, "_compiled", broken)
    logits, labels = _batch(torch.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    with pytest.warns(RuntimeWarning, match="compiled cross-entropy does not run on cpu.*RuntimeError: no working"):
        assert not fused_usable(flat, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once per device, dtype and vocabulary
        assert not fused_usable(flat, torch.float32)
        # on the CPU the default never tries the compiler (it would raise here)
        torch.testing.assert_close(causal_lm_losses(logits, labels).double(), dense_reference(logits, labels))


def test_bad_shapes_and_reductions_are_refused():
    logits, labels = _batch(torch.float32)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        causal_lm_losses(logits, labels, "none")
    with pytest.raises(ValueError, match=r"needs logits \(b, T, V\) and labels \(b, T\)"):
        causal_lm_losses(logits, labels[:, :-1])
    with pytest.raises(ValueError, match=r"needs logits \(b, T, V\)"):
        causal_lm_losses(logits[0], labels[0])


# Peak RSS above the RSS before the call, in a fresh process (memory freed by earlier tests could otherwise serve
# the allocations without a rise in RSS), for the forward pass and then the backward pass, of the loss under test
# and, as a control that the measurement sees a whole-logits copy, of the dense formula with the old float32 upcast.
_MEASURE = """
import json, sys, torch, torch.nn.functional as F
from prismdp.losses import causal_lm_losses
from prismdp.train.profile import RESET, PeakMemory, status_kb
torch.set_num_threads(1)
b, T, V = 2, 256, 49152

def old(logits, labels):
    tok = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], reduction="none")
    return tok.sum(1) / (labels[:, 1:] != -100).sum(1).clamp_min(1)

for fn in (causal_lm_losses, old):  # warm-up: library code and the allocator's first arenas are resident after it
    x = torch.randn(2, 8, V, dtype=torch.bfloat16).requires_grad_()
    fn(x, torch.randint(0, V, (2, 8))).sum().backward()
out = {}
for name, fn in (("new", causal_lm_losses), ("old", old)):
    x = torch.randn(b, T, V, dtype=torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (b, T))
    peak = PeakMemory("cpu").start()
    assert peak.measure == RESET, peak.measure
    rss0 = status_kb("VmRSS") / 1024
    loss = fn(x, y)
    forward = peak.read()["peak_memory_mb"] - rss0
    loss.sum().backward()
    total = peak.read()["peak_memory_mb"] - rss0
    out[name] = {"forward_mb": forward, "forward_backward_mb": total, "grad_mb": x.grad.nbytes / 2**20}
    del x, y, loss
out["whole_float32_mb"] = b * T * V * 4 / 2**20
print(json.dumps(out))
"""


def _run_isolated(code: str, timeout: float = 240) -> dict:
    # glibc's malloc keeps freed blocks in its heap, by a threshold it moves as the process runs, so the peak RSS
    # would be what it retained (measured: 18 or 33 MiB above the backward's live memory, varying run to run) rather
    # than what the loss holds; a fixed mmap threshold returns every freed block of 1 MiB or more to the system at
    # once, and the peak RSS becomes the peak of live memory (measured: the same to 0.2 MiB over six runs)
    res = run_python(code, timeout, env={"MALLOC_MMAP_THRESHOLD_": str(2**20)})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_loss_memory_is_a_few_chunks_not_a_float32_copy_of_the_logits():
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the measurement fixes glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_); another libc's malloc "
                    "may keep freed chunks resident")
    got = _run_isolated(_MEASURE)
    whole = got["whole_float32_mb"]  # 96 MiB: b x T x V x 4 bytes for 2 x 256 x 49,152
    chunk_mb = CHUNK_BYTES["cpu"] / 2**20  # the loss' float32 working set per chunk of tokens (4 MiB)
    # the control: the old formula's float32 copy (and its saved log-softmax) shows up in the measurement
    assert got["old"]["forward_mb"] > 0.9 * whole, got
    # the loss under test: two chunks' temporaries live at once in the forward pass (a chunk's upcast and its
    # log-sum-exp's; measured 7.7 MiB), 16 MiB at most where a whole float32 copy is 96 MiB; its backward adds the
    # logits' gradient (bf16, 48 MiB: the gradient every implementation returns) and again two chunks (measured 9 MiB)
    assert got["new"]["forward_mb"] < 3 * chunk_mb + 4, got
    assert got["new"]["forward_backward_mb"] < got["new"]["grad_mb"] + 3 * chunk_mb + 4, got
