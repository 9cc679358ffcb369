"""Per-example gradients of LoRA factors (and of dense trainable layers), from hooks on those layers only.

For a LoRA pair the per-example gradients come straight from the activations and output gradients of its two
small ``nn.Linear`` submodules: with ``x_t`` the (dropped-out) input of ``lora_A``, ``h_t = W_A x_t`` and
``d_t`` the gradient reaching ``lora_B``'s output at token t of example i,
``dL_i/dW_B = sum_t d_t h_t^T`` (m x r) and ``dL_i/dW_A = sum_t (W_B^T d_t) x_t^T`` (r x n):
O(T (m + n) r) per example, never an m x n matrix.  Dense trainable layers (e.g. a classification head) use
Opacus' per-layer-type samplers (``GradSampleModule.GRAD_SAMPLERS``).

Nothing is stored on parameters: :meth:`GradSampler.record` yields a :class:`Recording`, and
:meth:`Recording.grads` returns an explicit :class:`PerExampleGrads`.

The per-example gradients are exact only if the loss that is backpropagated is a *sum* of per-example losses,
each depending on its own example alone (see :mod:`prismdp.losses`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor, nn

from .lora import LoraPair, LoraSetupError, stack_by_shape

__all__ = ["PerExampleGrads", "GradSampler", "Recording", "dense_trainable_modules"]


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
    #: optional: the same LoRA gradients laid out per stack of equal-shape pairs (``stacks[i]`` lists pair indices)
    #: as ``stacked[i] = (g_WB (k, b, m, r), g_WA_T (k, b, n, r) or None)``; ``lora`` then holds views into them.
    stacks: list[list[int]] | None = None
    stacked: list[tuple[Tensor, Tensor | None]] | None = None


def _flat(t: Tensor) -> Tensor:
    """(b, ..., d) -> (b, T, d)."""
    return t.reshape(t.shape[0], -1, t.shape[-1])


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


class Recording:
    """Activations and output gradients captured during one forward/backward of one micro-batch."""

    def __init__(self, n_pairs: int, n_dense: int):
        self.lora_x: list[Tensor | None] = [None] * n_pairs  # input of lora_A (b, ..., n)
        self.lora_h: list[Tensor | None] = [None] * n_pairs  # input of lora_B (b, ..., r)
        self.lora_dy: list[Tensor | None] = [None] * n_pairs  # grad of lora_B output (b, ..., m)
        self.lora_dh: list[Tensor | None] = [None] * n_pairs  # grad of lora_A output (b, ..., r)
        self.dense_x: list[Tensor | None] = [None] * n_dense
        self.dense_dy: list[Tensor | None] = [None] * n_dense


class GradSampler:
    """Hooks that record what per-example gradients need, for LoRA pairs and dense trainable layers.

    Usage, scoped::

        sampler = GradSampler(model, pairs)
        with sampler.record() as rec:
            per_example_losses(model, batch).sum().backward()
        grads = sampler.grads(rec)

    or armed (what a training loop wants: every forward with grad enabled is recorded)::

        sampler.arm()
        per_example_losses(model, batch).sum().backward()
        grads = sampler.collect()   # and re-armed for the next micro-batch

    Forward passes under ``torch.no_grad()`` (evaluation) are never recorded.
    """

    def __init__(self, model: nn.Module, pairs: list[LoraPair]):
        self.pairs = pairs
        self.stacks = stack_by_shape(pairs)
        self.dense = dense_trainable_modules(model, pairs)
        self.dense_params = [p for _, ps in self.dense for p in ps]
        self._rec: Recording | None = None
        self._handles = []
        for k, pair in enumerate(pairs):
            if pair.trains_A:  # a frozen lora_A needs no per-example gradient
                self._handles.append(pair.lora_A.register_forward_hook(self._hook(k, "lora_x", "lora_dh")))
            self._handles.append(pair.lora_B.register_forward_hook(self._hook(k, "lora_h", "lora_dy")))
        for j, (module, _) in enumerate(self.dense):
            self._handles.append(module.register_forward_hook(self._hook(j, "dense_x", "dense_dy")))

    def _hook(self, index: int, act_slot: str, grad_slot: str):
        def forward_hook(module, inputs, output):
            rec = self._rec
            if rec is None or not torch.is_grad_enabled():
                return
            acts = getattr(rec, act_slot)
            if acts[index] is not None:
                raise LoraSetupError(
                    f"{type(module).__name__} was called twice in one forward pass (shared weights or gradient "
                    "checkpointing); per-example gradients for reused layers are not supported. Fix: disable "
                    "gradient checkpointing / weight sharing for the trained layers."
                )
            acts[index] = inputs[0].detach()

            def grad_hook(grad):
                getattr(rec, grad_slot)[index] = grad.detach()

            if output.requires_grad:
                output.register_hook(grad_hook)

        return forward_hook

    @contextlib.contextmanager
    def record(self) -> Iterator[Recording]:
        if self._rec is not None:
            raise RuntimeError("GradSampler.record() is already active")
        rec = Recording(len(self.pairs), len(self.dense))
        self._rec = rec
        try:
            yield rec
        finally:
            self._rec = None

    def arm(self) -> None:
        """Record every grad-enabled forward pass until :meth:`disarm`."""
        self._rec = Recording(len(self.pairs), len(self.dense))

    def disarm(self) -> None:
        self._rec = None

    def collect(self) -> PerExampleGrads:
        """Per-example gradients of the forward/backward just run in armed mode; re-arms."""
        if self._rec is None:
            raise RuntimeError("GradSampler.collect() needs arm() first")
        rec = self._rec
        self.arm()
        return self.grads(rec)

    def grads(self, rec: Recording) -> PerExampleGrads:
        """Per-example gradients from a finished recording (forward and backward done).

        Pairs of equal shape are written straight into one (k, b, m, r) buffer per stack (one batched matmul per pair,
        no copies), which PRISM consumes as a whole.
        """
        for k, pair in enumerate(self.pairs):
            if rec.lora_dy[k] is None or (pair.trains_A and (rec.lora_x[k] is None or rec.lora_dh[k] is None)):
                raise RuntimeError(
                    f"no activations/gradients were recorded for LoRA module {pair.name!r}: run the forward and "
                    "backward pass inside `with sampler.record():` with the LoRA adapter active"
                )
        lora: list = [None] * len(self.pairs)
        stacked = []
        batch = _flat(rec.lora_dy[0]).shape[0]
        for idx in self.stacks:
            first = self.pairs[idx[0]]
            m, n, r = first.shape
            dt, dev = rec.lora_dy[idx[0]].dtype, rec.lora_dy[idx[0]].device
            buf_b = torch.empty(len(idx), batch, m, r, dtype=dt, device=dev)
            buf_a = torch.empty(len(idx), batch, n, r, dtype=dt, device=dev) if first.trains_A else None
            for j, k in enumerate(idx):
                dy, h = _flat(rec.lora_dy[k]), _flat(rec.lora_h[k]).to(dt)
                torch.bmm(dy.mT, h, out=buf_b[j])  # sum_t d_t h_t^T        (b, m, r)
                if buf_a is not None:
                    x, dh = _flat(rec.lora_x[k]).to(dt), _flat(rec.lora_dh[k]).to(dt)
                    torch.bmm(x.mT, dh, out=buf_a[j])  # sum_t x_t (W_B^T d_t)^T  (b, n, r)
                lora[k] = (buf_b[j], buf_a[j] if buf_a is not None else None)
            stacked.append((buf_b, buf_a))
        dense = []
        from opacus.grad_sample import GradSampleModule

        for j, (module, params) in enumerate(self.dense):
            x, dy = rec.dense_x[j], rec.dense_dy[j]
            if x is None or dy is None:
                raise RuntimeError(f"no activations/gradients were recorded for dense module {type(module).__name__}")
            got = GradSampleModule.GRAD_SAMPLERS[type(module)](module, [x], dy)
            dense.extend(got[p] for p in params)
        return PerExampleGrads(batch_size=int(batch), lora=lora, dense=dense, stacks=self.stacks, stacked=stacked)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
