"""Per-example losses: each example's loss depends on that example alone, and the batch loss is their sum.

This is what makes per-example gradients (and hence the clipping bound) exact.  A token-mean over the whole
micro-batch (the paper's reference code) couples examples through their token counts; a mean over the batch
rescales every gradient by the realised batch size.  Neither is used here.

The causal-LM loss is computed on the fast path: cross-entropy over the last dimension of the flattened
``(b * T, V)`` logits, ``CHUNK_BYTES`` of float32 at a time (the logits' own dtype is read chunk by chunk and upcast
there), with the softmax recomputed per chunk in the backward pass.  Its memory beyond the logits and their gradient
is therefore a few chunks and one float per token, never a float32 copy of the whole ``(b, T, V)`` logits (issue 30).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["classification_losses", "causal_lm_losses", "fused_usable", "CHUNK_BYTES", "FUSED_CHUNK_BYTES",
           "IGNORE_INDEX"]

IGNORE_INDEX = -100
# Float32 working set of one chunk of tokens, by device.  CPU: 4 MiB (21 tokens at SmolLM2's vocabulary of 49,152),
# about the L2 cache, so each chunk's few passes (upcast, log-sum-exp, softmax, its gradient) run from cache: on
# 4 x 128 x 49,152 logits, 1 thread, forward + backward took 0.48-0.50 s at chunks of 8-21 tokens, 0.55 s at 32,
# 0.75 s at 85, 1.25 s at 256 and 1.66 s at 1024 (the whole-logits F.cross_entropy: 0.67-0.76 s).  GPU: 64 MiB
# (130 tokens at Llama 3's 128,256, 64 at Gemma 3's 262,144): every kernel is still megabytes of work, a 2,048-token
# micro-batch is 16-32 chunks (a few kernel launches each, well under a millisecond in all), and the loss' memory
# beyond the logits and their gradient stays far below the logits themselves.
CHUNK_BYTES = {"cpu": 4 * 2**20, "cuda": 64 * 2**20}
# The compiled (fused) kernels never hold a float32 chunk (each reads the logits' own dtype and keeps the upcast in
# registers), so their chunk only bounds the gradient's transient copy: 1 GiB of float32 rows, i.e. 2,093 tokens at
# Llama 3's vocabulary (a 32 x 256 micro-batch in 4 chunks, a few kernels each, against 63 chunks of about 15
# kernels on the eager path).
FUSED_CHUNK_BYTES = 2**30


def classification_losses(logits: Tensor, labels: Tensor) -> Tensor:
    """(b,) cross-entropy per example; mean-squared error when ``logits`` has one column (regression)."""
    if logits.shape[-1] == 1:
        return (logits.squeeze(-1).float() - labels.float()).square()
    return F.cross_entropy(logits.float(), labels, reduction="none")


def _chunks(n: int, size: int):
    return ((s, min(s + size, n)) for s in range(0, n, size))


def _rows(flat: Tensor, rows: Tensor | None, s: int, e: int) -> Tensor:
    return flat[s:e] if rows is None else flat[rows[s:e]]


def _lse_and_picked(x: Tensor, safe: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per row of ``x``: ``logsumexp`` and the target's logit, in ``acc``."""
    x = x.to(acc)
    return torch.logsumexp(x, dim=1), x.gather(1, safe).squeeze(1)


def _eager_grad(x: Tensor, safe: Tensor, lse: Tensor, g: Tensor) -> Tensor:
    """``(softmax(x) - one_hot(target)) * g`` per row, in ``lse``'s dtype, by in-place passes over one upcast."""
    p = x.to(lse.dtype)
    p = torch.exp(p.sub_(lse[:, None]) if p.dtype != x.dtype else p - lse[:, None])
    p.scatter_add_(1, safe, -torch.ones_like(p[:, :1]))
    return p.mul_(g)


def _fused_grad(x: Tensor, safe: Tensor, lse: Tensor, g: Tensor) -> Tensor:
    """The same gradient written as one element-wise expression (no scatter, no in-place pass), in ``x``'s dtype,
    so that a compiler makes it one kernel that reads ``x`` once and writes the result once."""
    hit = torch.arange(x.shape[1], device=x.device) == safe
    return ((torch.exp(x.to(lse.dtype) - lse[:, None]) - hit.to(lse.dtype)) * g).to(x.dtype)


_FUSED_USABLE: dict = {}  # (device, dtype, acc, V) -> whether the compiled kernels ran there


@functools.cache
def _compiled(fn):
    """``fn`` compiled, once per process."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _probe(flat: Tensor, acc: torch.dtype) -> None:
    x = torch.zeros(4, flat.shape[1], dtype=flat.dtype, device=flat.device)[:2]
    safe = torch.zeros(4, 1, dtype=torch.long, device=flat.device)[:2]
    lse = torch.zeros(4, dtype=acc, device=flat.device)[:2]
    _compiled(_lse_and_picked)(x, safe, acc)
    _compiled(_fused_grad)(x, safe, lse, torch.ones(4, dtype=acc, device=flat.device)[:, None][:2])


def fused_usable(flat: Tensor, acc: torch.dtype) -> bool:
    """Do the compiled kernels build and run for these logits' device, dtype and vocabulary?  Tried once per
    (device, dtype, vocabulary) on two rows (the compilation the first real call would pay anyway; dynamic shapes, so
    the row count does not recompile).  A failure (no Triton, no C++ compiler, an unsupported device) is reported
    once as a warning and the chunked eager loss is used instead."""
    key = (flat.device, flat.dtype, acc, flat.shape[1])
    if key not in _FUSED_USABLE:
        try:  # slices without autograd, as the real calls pass (a guard would otherwise recompile those)
            with torch.no_grad():
                _probe(flat, acc)
            _FUSED_USABLE[key] = True
        except Exception as err:  # noqa: BLE001 - any compiler failure means: use the eager loss
            if isinstance(err, torch.OutOfMemoryError):
                raise
            warnings.warn(f"prismdp: the compiled cross-entropy does not run on {flat.device} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); using the chunked eager one (same "
                          "values, slower on a GPU). Pass fused=False to causal_lm_losses to skip this attempt.",
                          RuntimeWarning, stacklevel=3)
            _FUSED_USABLE[key] = False
    return _FUSED_USABLE[key]


class _TokenCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy ``logsumexp(x) - x[target]`` of ``flat[rows]`` (all rows when ``rows`` is None; a
    target of ``IGNORE_INDEX`` gives 0 and no gradient), computed ``chunk`` rows at a time in ``acc`` (float32 or
    float64), by the compiled kernels when ``fused``.  Saves the logits themselves (no copy) and one log-sum-exp per
    row; the backward pass recomputes each chunk's softmax and writes the gradient into a tensor of the logits'
    dtype."""

    @staticmethod
    def forward(ctx, flat: Tensor, rows: Tensor | None, targets: Tensor, chunk: int, acc: torch.dtype,
                fused: bool) -> Tensor:
        n = targets.numel()
        valid = targets != IGNORE_INDEX
        safe = targets.masked_fill(~valid, 0).unsqueeze(1)
        lse = torch.empty(n, dtype=acc, device=flat.device)
        picked = torch.empty(n, dtype=acc, device=flat.device)
        kernel = _compiled(_lse_and_picked) if fused else _lse_and_picked
        src = flat.detach()  # the kernels see plain tensors (a compiled kernel would also recompile on requires_grad)
        for s, e in _chunks(n, chunk):
            lse[s:e], picked[s:e] = kernel(_rows(src, rows, s, e), safe[s:e], acc)
        ctx.save_for_backward(flat, rows, safe, valid, lse)
        ctx.chunk, ctx.acc, ctx.fused = chunk, acc, fused
        return (lse - picked).masked_fill_(~valid, 0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        flat, rows, safe, valid, lse = ctx.saved_tensors
        g = grad_out.to(ctx.acc).masked_fill(~valid, 0).unsqueeze(1)
        n = safe.shape[0]
        kernel = _compiled(_fused_grad) if ctx.fused else _eager_grad
        src = flat.detach()
        if rows is None and ctx.fused and 0 < n <= ctx.chunk:  # one chunk: its result is the gradient, no copy
            return kernel(src[0:n], safe[0:n], lse[0:n], g[0:n]), None, None, None, None, None
        grad = torch.empty_like(flat) if rows is None else torch.zeros_like(flat)
        for s, e in _chunks(n, ctx.chunk):
            p = kernel(_rows(src, rows, s, e), safe[s:e], lse[s:e], g[s:e])
            if rows is None:
                grad[s:e] = p
            else:
                grad[rows[s:e]] = p.to(grad.dtype)
        return grad, None, None, None, None, None


def causal_lm_losses(logits: Tensor, labels: Tensor, reduction: str = "mean", *, gather: bool = False,
                     chunk_tokens: int | None = None, fused: bool | None = None) -> Tensor:
    """(b,) next-token loss per example over its own target tokens (``labels != -100``).

    ``reduction="mean"`` averages over the example's own target tokens (0 if it has none); ``"sum"`` sums them.
    Values and gradients are those of ``F.cross_entropy`` over the shifted float32 logits (float64 stays float64);
    the result is float32 for float32, bfloat16 and float16 logits.

    ``gather=True`` computes only the target tokens' rows, skipping masked prompts and padding: less work when many
    tokens are masked, a copy of each row otherwise, and the rows' count read on the host, which on a GPU is one
    synchronisation per call (issue 30 budgets two per logical step).  So it is opt-in; by default the masked rows are
    computed and zeroed, with no host read.  ``chunk_tokens`` overrides the rows per chunk (default:
    ``CHUNK_BYTES`` of the device, or ``FUSED_CHUNK_BYTES`` fused).

    ``fused`` (default: on CUDA) computes each chunk with ``torch.compile``'d kernels instead of eager passes: on a
    GPU one kernel reads a chunk's logits for the log-sum-exp and one writes its gradient, instead of about fifteen
    float32 passes per 64 MiB chunk (``bench/results/gpu-h200-cholqr``: the eager loss was the largest kernel time
    prismdp adds to a Llama step).  The first call per device, dtype and vocabulary compiles (seconds); where that
    fails, a warning and the eager path (:func:`fused_usable`).  ``fused=True`` compiles on the CPU too (tests).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"causal_lm_losses needs logits (b, T, V) and labels (b, T); got logits "
                         f"{tuple(logits.shape)} and labels {tuple(labels.shape)}")
    b, T, V = logits.shape
    # position t predicts labels[:, t + 1]; the last position of each example predicts nothing
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    acc = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.reshape(b * T, V)  # a view of contiguous logits; the model's output is contiguous
    if fused is None:
        fused = logits.is_cuda and fused_usable(flat, acc)
    budget = FUSED_CHUNK_BYTES if fused else CHUNK_BYTES.get(logits.device.type, CHUNK_BYTES["cuda"])
    chunk = chunk_tokens or max(1, budget // (V * torch.finfo(acc).bits // 8))
    targets = shifted.reshape(-1) != IGNORE_INDEX
    if gather:
        rows = targets.nonzero().squeeze(1)
        tok = _TokenCrossEntropy.apply(flat, rows, shifted.reshape(-1)[rows], chunk, acc, fused)
        total = torch.zeros(b, dtype=acc, device=logits.device).index_add_(0, rows // T, tok)
    else:
        total = _TokenCrossEntropy.apply(flat, None, shifted.reshape(-1), chunk, acc, fused).view(b, T).sum(dim=1)
    if reduction == "sum":
        return total
    count = targets.view(b, T).sum(dim=1)
    return total / count.clamp_min(1)
