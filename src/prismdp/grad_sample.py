"""Per-example gradients of LoRA factors (and of dense trainable layers), from taps on those layers only.

For a LoRA pair the per-example gradients come straight from the activations and output gradients of its two
small ``nn.Linear`` submodules: with ``x_t`` the (dropped-out) input of ``lora_A``, ``h_t = W_A x_t`` and
``d_t`` the gradient reaching ``lora_B``'s output at token t of example i,
``dL_i/dW_B = sum_t d_t h_t^T`` (m x r) and ``dL_i/dW_A = sum_t (W_B^T d_t) x_t^T`` (r x n):
O(T (m + n) r) per example, never an m x n matrix.  Dense trainable layers (e.g. a classification head) use
Opacus' per-layer-type samplers (``GradSampleModule.GRAD_SAMPLERS``).

How: a forward hook wraps each tapped module's output in :class:`_Tap`, an identity autograd function that saves the
module's input.  Its backward receives the output gradient as soon as the backward pass reaches the module, computes
that module's per-example gradients there (in float32 or wider: activations and gradients of bf16/fp16 models are
cast up) and returns; the saved input is released with the node.  So the DP path keeps no (b, T, m) output gradient
alive until the end of the backward pass, and it works with gradient checkpointing in both of torch's modes: in
re-entrant mode the first forward runs without grad (no tap) and the recomputation's taps fire; in non-re-entrant mode
the recomputation only refills saved tensors, its taps never fire, and the first forward's taps get the recomputed
inputs.  A module called twice in one forward (shared weights) contributes the sum of its calls, as autograd would.
While recording, a LoRA factor's forward runs with its weight's ``requires_grad`` off (restored as it returns), so
autograd computes no batch-summed ``.grad`` for the factors: the per-example gradients replace it, and its matrix
products (as large as the taps' own) would be thrown away.

**Precision of the products** (:attr:`GradSampler.products`): ``"float32"`` (the default) multiplies in float32
(on CUDA without TF32: torch's default); ``"tf32"`` rounds the inputs to TF32 (10-bit mantissa; on CUDA: TF32 tensor
cores for these products only) and ``"bf16"`` to bfloat16 (8-bit mantissa), both accumulating in float32.  Per
example and factor, with ``kappa = || |L| |R| ||_F / || L R ||_F`` of the product ``L R`` (1 without cancellation
over tokens), rounding both inputs with unit roundoff u adds a relative Frobenius error of at most about
``2 u kappa`` (u = 2^-11 for TF32, 2^-9 for bf16; ``tests/test_grad_sample.py`` tests that bound against float64,
and ``docs/gpu-readiness.md`` states the measured errors).  On a bf16 base one of the two inputs of every LoRA
product (the bf16 layer input ``x``, or the output gradient reaching ``lora_B``) is already bf16-exact.

Nothing is stored on parameters: :meth:`GradSampler.record` yields a :class:`Recording`, and
:meth:`Recording.grads` returns an explicit :class:`PerExampleGrads`.

The per-example gradients are exact only if the loss that is backpropagated is a *sum* of per-example losses,
each depending on its own example alone (see :mod:`prismdp.losses`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from .lora import LoraPair, LoraSetupError, stack_by_shape

__all__ = ["PerExampleGrads", "GradSampler", "Recording", "dense_trainable_modules", "float32_trainables", "PRODUCTS",
           "product"]


@dataclass
class PerExampleGrads:
    """Per-example gradients of one micro-batch, in parameter space.

    ``lora[k] = (g_WB, g_WA_T)`` for pair k: ``g_WB`` (b, m, r) is the gradient of ``lora_B.weight`` and
    ``g_WA_T`` (b, n, r) the *transposed* gradient of ``lora_A.weight`` (``None`` when the pair's ``lora_A`` is
    frozen, ``pair.trainable == "B"``).  ``dense[j]`` is (b, *p.shape) for the j-th dense trainable parameter.
    """

    batch_size: int
    lora: list[tuple[Tensor, Tensor | None]]
    dense: list[Tensor] = field(default_factory=list)
    #: optional: the same LoRA gradients laid out per stack of equal-shape pairs (``stacks[i]`` lists pair indices),
    #: rank-major: ``stacked[i] = (g_WB^T (k, b, r, m), g_WA (k, b, r, n) or None)``, contiguous; ``lora`` then holds
    #: transposed views into them.  Rank-major is the layout the taps compute fastest (see :class:`Recording`) and the
    #: one in which ``Q_A^T g_A`` needs no copy of the frame per example.
    stacks: list[list[int]] | None = None
    stacked: list[tuple[Tensor, Tensor | None]] | None = None

    def sum_by(self, groups: Tensor, n_groups: int) -> "PerExampleGrads":
        """Per-group sums over the examples (``groups`` (b,) holds each example's group in ``0..n_groups-1``): the
        gradients of privacy units that own several examples (user-level privacy), which are then clipped as one."""
        groups = groups.to(self.lora[0][0].device)

        def add(t: Tensor, dim: int) -> Tensor:
            shape = list(t.shape)
            shape[dim] = n_groups
            return torch.zeros(shape, dtype=t.dtype, device=t.device).index_add_(dim, groups, t)

        stacked = [(add(b, 1), add(a, 1) if a is not None else None) for b, a in self.stacked] \
            if self.stacked is not None else None
        if stacked is not None:
            lora: list = [None] * len(self.lora)
            for idx, (b, a) in zip(self.stacks, stacked):
                for j, k in enumerate(idx):
                    lora[k] = (b[j].mT, a[j].mT if a is not None else None)
        else:
            lora = [(add(b, 0), add(a, 0) if a is not None else None) for b, a in self.lora]
        return PerExampleGrads(n_groups, lora, [add(d, 0) for d in self.dense], self.stacks, stacked)


def _flat(t: Tensor) -> Tensor:
    """(b, ..., d) -> (b, T, d)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _work(t: Tensor) -> Tensor:
    """float32 for bf16/fp16 tensors (per-example gradients are never accumulated in half precision)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


PRODUCTS = ("float32", "tf32", "bf16")


def _round_mantissa(t: Tensor, bits: int) -> Tensor:
    """float32 ``t`` rounded to nearest (ties to even) with ``bits`` explicit mantissa bits (TF32: 10), as float32."""
    drop = 23 - bits
    i = t.view(torch.int32)
    keep_lsb = (i >> drop) & 1
    rounded = (i + ((1 << (drop - 1)) - 1) + keep_lsb) & ~((1 << drop) - 1)
    return torch.where(torch.isfinite(t), rounded.view(torch.float32), t)


@contextlib.contextmanager
def _tf32_matmul(device: torch.device) -> Iterator[None]:
    """TF32 tensor cores for the float32 matmuls inside (CUDA; restored after)."""
    if device.type != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def product(left: Tensor, right: Tensor, precision: str, out: Tensor | None = None) -> Tensor:
    """``torch.bmm(left, right)`` of float32 operands in ``precision`` (:data:`PRODUCTS`), accumulated in float32
    (float64 operands are multiplied in float64 whatever ``precision``).  On the CPU, TF32 and bf16 are emulated
    exactly: the inputs rounded, then a float32 product (the products of two rounded values are exact in float32)."""
    if precision == "float32" or left.dtype == torch.float64:
        return torch.bmm(left, right, out=out)
    if precision == "tf32":
        if left.is_cuda:
            with _tf32_matmul(left.device):
                return torch.bmm(left, right, out=out)
        return torch.bmm(_round_mantissa(left, 10), _round_mantissa(right, 10), out=out)
    if precision == "bf16":
        lo, ro = left.to(torch.bfloat16), right.to(torch.bfloat16)
        if left.is_cuda:
            got = torch.bmm(lo, ro, out_dtype=torch.float32)
            return got if out is None else out.copy_(got)
        return torch.bmm(lo.float(), ro.float(), out=out)
    raise ValueError(f"per-example products in {precision!r}: choose one of {PRODUCTS}")


def dense_trainable_modules(model: nn.Module, pairs: list[LoraPair]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Modules owning trainable parameters that are not LoRA factors, each with its trainable parameters.

    Raises :class:`LoraSetupError` if such a parameter sits in a layer type without a per-example sampler,
    since its gradient would escape the privacy guarantee.
    """
    from opacus.grad_sample import GradSampleModule

    lora_params = {id(p) for pair in pairs for p in pair.params}
    out = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in lora_params]
        if not own:
            continue
        if type(module) not in GradSampleModule.GRAD_SAMPLERS:
            names = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            raise LoraSetupError(
                f"trainable parameters {names} of module {name!r} ({type(module).__name__}) have no per-example "
                "gradient sampler, so they would escape the privacy guarantee. Fix: freeze them "
                "(p.requires_grad_(False)) or make them LoRA targets; supported dense layer types: "
                + ", ".join(sorted(t.__name__ for t in GradSampleModule.GRAD_SAMPLERS))
            )
        out.append((module, own))
    return out


class _RunInFloat32:
    """Hooks that run a module converted to float32 inside a half-precision model: floating-point inputs are cast up
    (pre-hook), the output is cast back to the dtype the first floating-point input had (forward hook)."""

    def __init__(self, module: nn.Module):
        self.dtype = None
        module.float()
        module.register_forward_pre_hook(self.cast_up)
        module.register_forward_hook(self.cast_back)

    def cast_up(self, module, args):
        self.dtype = next((a.dtype for a in args if isinstance(a, Tensor) and a.is_floating_point()), None)
        return tuple(a.float() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)

    def cast_back(self, module, args, output):
        return output.to(self.dtype) if self.dtype is not None and isinstance(output, Tensor) else output


def float32_trainables(model: nn.Module, pairs: list[LoraPair]) -> list[str]:
    """Keep everything trained in float32 when the base model is bf16/fp16.

    LoRA factors must already be float32 (PEFT's ``autocast_adapter_dtype=True``, its default, does that); a
    half-precision factor is refused.  Dense trainable modules (a classification head) in half precision are
    converted to float32 and run in float32 (:class:`_RunInFloat32`); the gradient sampler's taps, registered first,
    see their float32 output.  Returns the names of the converted modules.
    """
    lora = {id(p) for pair in pairs for p in pair.params}
    for pair in pairs:
        for p in pair.trained_params:
            if p.dtype in (torch.bfloat16, torch.float16):
                raise LoraSetupError(
                    f"LoRA module {pair.name!r} has {p.dtype} factors; prismdp trains LoRA factors in float32. Fix: "
                    "create the model with peft.get_peft_model(model, config, autocast_adapter_dtype=True) (the "
                    "default), or cast the adapter weights to float32.")
    converted = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in lora]
        if any(p.dtype in (torch.bfloat16, torch.float16) for p in own):
            _RunInFloat32(module)
            converted.append(name)
    return converted


class _Tap(torch.autograd.Function):
    """Identity on ``out``; its backward hands ``(inp, grad of out)`` to ``sink`` and lets the gradient through.
    ``anchor`` (a scalar that requires grad, or None) makes the output require grad even when nothing else does: a
    LoRA factor runs its forward with ``requires_grad`` off (see :meth:`GradSampler._tap`), and in the first layer its
    input comes from frozen embeddings."""

    @staticmethod
    def forward(ctx, out: Tensor, inp: Tensor, sink: Callable[[Tensor, Tensor], None], anchor: Tensor | None = None
                ) -> Tensor:
        ctx.save_for_backward(inp)
        ctx.sink = sink
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inp,) = ctx.saved_tensors
        ctx.sink(inp, grad)
        return grad, None, None, None


class Recording:
    """Per-example gradients of one micro-batch, filled in by the taps during its backward pass.

    ``stacked[i] = [g_WB^T (k, b, r, m), g_WA (k, b, r, n) or None]`` for stack ``stacks[i]`` (rank-major), allocated
    when the first gradient of the stack arrives; ``dense[j]`` per dense parameter (b, *p.shape).  The taps write
    ``h^T dy`` (b, r, m) and ``dh^T x`` (b, r, n), rank-major: faster than ``dy^T h`` (b, m, r) on the CPU (measured
    in docs/performance.md, "Design choices measured").
    """

    def __init__(self, sampler: GradSampler):
        self.sampler = sampler
        self.stacked: list[list[Tensor | None]] = [[None, None] for _ in sampler.stacks]
        self.written: list[list[bool]] = [[False, False] for _ in sampler.pairs]  # per pair: (lora_B, lora_A)
        self.dense: list[Tensor | None] = [None] * len(sampler.dense_params)

    def lora_sink(self, k: int, part: int) -> Callable[[Tensor, Tensor], None]:
        """``part`` 0: lora_B (input h, output gradient dy -> dy^T h); 1: lora_A (input x, gradient dh -> x^T dh)."""
        sampler = self.sampler
        i, j = sampler.position[k]
        m, n, r = sampler.pairs[k].shape

        def sink(inp: Tensor, grad: Tensor) -> None:
            g, a = _flat(_work(grad)), _flat(_work(inp))
            dt = torch.promote_types(g.dtype, a.dtype)
            g, a = g.to(dt), a.to(dt)
            stack = self.stacked[i]
            if stack[part] is None:
                cols = m if part == 0 else n
                stack[part] = torch.empty(len(sampler.stacks[i]), g.shape[0], r, cols, dtype=dt, device=g.device)
            left, right = (a.mT, g) if part == 0 else (g.mT, a)  # h^T dy (b, r, m) / dh^T x (b, r, n)
            if self.written[k][part]:  # a second call of the module in this forward: its contributions add up
                stack[part][j].add_(product(left, right, sampler.products))
            else:
                product(left, right, sampler.products, out=stack[part][j])
            self.written[k][part] = True

        return sink

    def dense_sink(self, j: int) -> Callable[[Tensor, Tensor], None]:
        from opacus.grad_sample import GradSampleModule

        module, params = self.sampler.dense[j]
        first = self.sampler.dense_offsets[j]

        def sink(inp: Tensor, grad: Tensor) -> None:
            got = GradSampleModule.GRAD_SAMPLERS[type(module)](module, [_work(inp)], _work(grad))
            for q, p in enumerate(params):
                slot = first + q
                if self.dense[slot] is None:
                    self.dense[slot] = got[p]
                else:
                    self.dense[slot].add_(got[p])

        return sink

    def grads(self) -> PerExampleGrads:
        """The per-example gradients of the finished forward and backward pass."""
        sampler = self.sampler
        for k, pair in enumerate(sampler.pairs):
            if not self.written[k][0] or (pair.trains_A and not self.written[k][1]):
                raise RuntimeError(
                    f"no per-example gradient was recorded for LoRA module {pair.name!r}: run the forward and "
                    "backward pass inside `with sampler.record():` (or armed) with the LoRA adapter active, and "
                    "backpropagate a loss that depends on the module"
                )
        for j, g in enumerate(self.dense):
            if g is None:
                raise RuntimeError(f"no per-example gradient was recorded for dense parameter {j} "
                                   f"({type(sampler.dense[0][0]).__name__})")
        lora: list = [None] * len(sampler.pairs)
        stacked = []
        for i, idx in enumerate(sampler.stacks):
            buf_b, buf_a = self.stacked[i]
            stacked.append((buf_b, buf_a))
            for j, k in enumerate(idx):
                lora[k] = (buf_b[j].mT, buf_a[j].mT if buf_a is not None else None)
        batch = int(stacked[0][0].shape[1])
        return PerExampleGrads(batch_size=batch, lora=lora, dense=list(self.dense), stacks=sampler.stacks,
                               stacked=stacked)


class GradSampler:
    """Taps that compute per-example gradients for LoRA pairs and dense trainable layers.

    Usage, scoped::

        sampler = GradSampler(model, pairs)
        with sampler.record() as rec:
            per_example_losses(model, batch).sum().backward()
        grads = sampler.grads(rec)

    or armed (what a training loop wants: every forward with grad enabled is recorded)::

        sampler.arm()
        per_example_losses(model, batch).sum().backward()
        grads = sampler.collect()   # and re-armed for the next micro-batch

    Forward passes under ``torch.no_grad()`` (evaluation) are never recorded.  :meth:`close` removes the hooks.
    """

    def __init__(self, model: nn.Module, pairs: list[LoraPair]):
        self.pairs = pairs
        self.stacks = stack_by_shape(pairs)
        self.position = {k: (i, j) for i, idx in enumerate(self.stacks) for j, k in enumerate(idx)}
        self.dense = dense_trainable_modules(model, pairs)
        self.dense_params = [p for _, ps in self.dense for p in ps]
        self.dense_offsets = [sum(len(ps) for _, ps in self.dense[:j]) for j in range(len(self.dense))]
        self._rec: Recording | None = None
        self._handles = []
        self._anchor = torch.zeros((), requires_grad=True)
        #: True: let autograd also compute the LoRA factors' batch-summed ``.grad`` while recording (the old
        #: behaviour; bench's ``prism-summed-grads`` ablation measures what skipping it gains)
        self.summed_lora_grads = False
        #: the LoRA taps' products: "float32" (default), "tf32" or "bf16" inputs, float32 accumulation (see the module
        #: docstring for the error bound)
        self.products = "float32"
        for k, pair in enumerate(pairs):
            if pair.trains_A:  # a frozen lora_A needs no per-example gradient
                self._tap(pair.lora_A, lambda rec, k=k: rec.lora_sink(k, 1), own_grads=False)
            self._tap(pair.lora_B, lambda rec, k=k: rec.lora_sink(k, 0), own_grads=False)
        for j, (module, _) in enumerate(self.dense):
            self._tap(module, lambda rec, j=j: rec.dense_sink(j))

    def _recording(self) -> bool:
        return self._rec is not None and torch.is_grad_enabled()

    def _tap(self, module: nn.Module, make_sink: Callable[[Recording], Callable], own_grads: bool = True) -> None:
        """Tap ``module``'s output.  ``own_grads=False`` (LoRA factors): while recording, the module's forward runs
        with its parameters' ``requires_grad`` off and restored right after, so the backward pass computes only the
        gradient of its input, not the (b*T)-summed weight gradient the per-example gradients make redundant (a
        matrix product as large as the tap's own per module, and the ``.grad`` buffers it fills); the tap's anchor
        keeps the output in the graph."""
        toggled: list[list[nn.Parameter]] = []
        own = list(module.parameters(recurse=False))  # listed once: parameters() has a host cost per call

        def pre_hook(module, inputs):
            if self._recording() and not self.summed_lora_grads:
                params = [p for p in own if p.requires_grad]
                for p in params:
                    p.requires_grad_(False)
                toggled.append(params)

        def forward_hook(module, inputs, output):
            if toggled:
                for p in toggled.pop():
                    p.requires_grad_(True)
            rec = self._rec
            if not self._recording() or not isinstance(output, Tensor):
                return None
            if own_grads:
                return _Tap.apply(output, inputs[0], make_sink(rec)) if output.requires_grad else None
            return _Tap.apply(output, inputs[0], make_sink(rec), self._anchor)

        # first among the module's forward hooks: the tap sees the module's own output (float32 for a head run in
        # float32 inside a half-precision model, before it is cast back); always_call: requires_grad is restored
        # even when the forward raises
        if not own_grads:
            self._handles.append(module.register_forward_pre_hook(pre_hook, prepend=True))
        self._handles.append(module.register_forward_hook(forward_hook, prepend=True, always_call=True))

    @contextlib.contextmanager
    def record(self) -> Iterator[Recording]:
        if self._rec is not None:
            raise RuntimeError("GradSampler.record() is already active")
        rec = Recording(self)
        self._rec = rec
        try:
            yield rec
        finally:
            self._rec = None

    @property
    def armed(self) -> bool:
        return self._rec is not None

    def arm(self) -> None:
        """Record every grad-enabled forward pass until :meth:`disarm`."""
        self._rec = Recording(self)

    def disarm(self) -> None:
        self._rec = None

    def collect(self) -> PerExampleGrads:
        """Per-example gradients of the forward/backward just run in armed mode; re-arms."""
        if self._rec is None:
            raise RuntimeError("GradSampler.collect() needs arm() first")
        rec = self._rec
        self.arm()
        return rec.grads()

    def grads(self, rec: Recording) -> PerExampleGrads:
        """Per-example gradients from a finished recording (forward and backward done)."""
        return rec.grads()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._rec = None
