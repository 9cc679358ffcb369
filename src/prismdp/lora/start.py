"""The rank-r start: every LoRA pair put on the rank-r manifold without changing the model's function.

PEFT initialises ``W_B = 0`` (Z = 0, off the rank-r manifold).  :func:`move_to_rank_r_start` picks a rank-r
point ``Z0`` with balanced factors and takes it out of the layer again, so the model computes the same function as
before while the trainable point sits on the manifold.  :class:`RankRStart` records ``Z0`` so the trained adapter
can be exported for the *original* base weights (``Z - Z0`` has rank <= 2r).  ``W0`` is read, and ``W0 - Z0``
written, only through the seam of :mod:`prismdp.base` (de-quantized or gathered one layer at a time).

Where ``Z0`` goes.  Without LoRA dropout, on a base whose storage has room for it (:func:`prismdp.base.start_in_base`:
a float weight, sharded or not), into the base: ``W0 <- W0 - Z0``.  Otherwise into the LoRA branch
(:class:`StartDropoutCompensation`):

* LoRA dropout: PEFT computes ``W0' x + Z drop(x)``.  With ``W0' = W0 - Z0`` that would also drop inputs of
  ``Z0 x``, a slice of the pretrained weight (its top-r part with the spectral start) rather than of the learned
  update, and the train-mode model would not be the model being fine-tuned (measured on SmolLM2-135M, dropout 0.05
  on q/k/v/up/down: the first-batch loss rises from 1.79 to 2.19 and PRISM's training loss swings up to 4.2).  The
  branch computes ``(Z - Z0) drop(x)`` on the unchanged ``W0``: ordinary LoRA dropout on the update, which is also
  what the exported rank-2r adapter computes on the original base;
* a quantized base (bitsandbytes 4/8-bit, torchao's NF4): the weight must never be rewritten (``W0 - Z0``
  re-quantized would change the model by a new quantization error); ``Z0`` is computed from the de-quantized
  ``W0`` (what the layer multiplies by) and the layer computes ``Q(W0) x + (Z - Z0) drop(x)``, the same function as
  before the start.

The branch is carried by PEFT's own LoRA-variant interface (``peft.tuners.lora.layer.LoraVariant``, the interface
DoRA uses; read on PEFT 0.21.2): the pair's ``lora_variant[adapter]`` is a :class:`StartInBranch`, whose
``forward`` PEFT calls in place of ``lora_B(lora_A(dropout(x))) * scaling`` and whose ``merge_safe`` /
``merge_unsafe`` / ``unmerge`` PEFT's ``merge()`` / ``unmerge()`` / ``merge_and_unload()`` call.  No PEFT module
changes its class or has a method replaced: ``lora_A`` and ``lora_B`` stay ``nn.Linear`` and are called as modules,
so the per-example taps on them see ``drop(x)``, ``h = W_A drop(x)`` and the gradient at ``lora_B``'s output as in a
plain pair.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .. import base as frozen
from .. import geometry
from .pairs import LoraPair, LoraSetupError, set_factors

__all__ = ["RankRStart", "StartDropoutCompensation", "StartInBranch", "move_to_rank_r_start", "base_weight"]


def _transposed(pair: LoraPair) -> bool:
    return bool(getattr(pair.layer, "fan_in_fan_out", False))


def base_weight(pair: LoraPair, dtype: torch.dtype = torch.float64) -> Tensor:
    """The pair's frozen ``W0`` (m, n) in ``dtype``, read through the seam of :mod:`prismdp.base`: a quantized weight
    de-quantized (by bitsandbytes' or torchao's own de-quantization: what the layer multiplies by), a sharded one
    gathered; one layer only."""
    weight = frozen.read_weight(pair.layer.get_base_layer(), dtype)
    return weight.T if _transposed(pair) else weight


def _write_base_weight(pair: LoraPair, value: Tensor) -> None:
    """Store ``value`` (m, n) as the pair's frozen weight (a float base only, :func:`prismdp.base.write_weight`)."""
    frozen.write_weight(pair.layer.get_base_layer(), value.T if _transposed(pair) else value)


def _start_in_branch(pair: LoraPair) -> bool:
    """Whether the LoRA branch subtracts ``Z0`` (LoRA dropout, or a base whose storage cannot take ``W0 - Z0``:
    :func:`prismdp.base.start_in_base`) rather than the base weight."""
    return _dropout_active(pair) or not frozen.start_in_base(pair.layer.get_base_layer())


def _dropout_active(pair: LoraPair) -> bool:
    drop = pair.layer.lora_dropout[pair.adapter]
    return isinstance(drop, nn.Dropout) and drop.p > 0


def _top_svd(W: Tensor, r: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-r singular triplets (U (m, r), S (r,), V (n, r)); randomized for large matrices."""
    if min(W.shape) <= 1024:
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        return U[:, :r], S[:r], Vh[:r].T
    U, S, V = torch.svd_lowrank(W, q=r + 10, niter=4)
    return U[:, :r], S[:r], V[:, :r]


def _factor_precision(t: Tensor):
    """The started branch computes in its factors' dtype (float32), autocast or not (under autocast ``F.linear`` would
    return bf16, and the backward, which autocast does not reach, would mix dtypes).  Entered only where autocast is
    on: the context itself cost the layer 2-3 % at W0's and W1's shapes."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _start_update(pair: LoraPair, dtype: torch.dtype) -> Tensor:
    """``Z0 = A0 B0^T`` (m, n) of a started pair from its buffers (``start_c0 = -A0 / s``, ``start_b0t = B0^T``)."""
    return (-pair.scaling * _as(pair.lora_B.start_c0, dtype)) @ _as(pair.lora_A.start_b0t, dtype)


class _StartProduct(torch.autograd.Function):
    """``x w^T`` (plus ``add``, in the same product where given) with ``w`` one of the start's constant factors: the
    backward forms the input's gradient only, and only where it flows on (the first LoRA layer, below nothing
    trainable, skips it).  Named, so that a profile shows what the start in the branch costs (``bench.profile``)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, add: Tensor | None = None) -> Tensor:
        ctx.save_for_backward(w)
        if add is None:
            return F.linear(x, w)
        out = torch.addmm(add.reshape(-1, add.shape[-1]), x.reshape(-1, x.shape[-1]), w.T)
        return out.view(add.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (w,) = ctx.saved_tensors
        dx = grad @ w if ctx.needs_input_grad[0] else None
        if len(ctx.needs_input_grad) == 2:  # called without add
            return dx, None
        return dx, None, (grad if ctx.needs_input_grad[2] else None)


class StartInBranch:
    """PEFT LoRA variant of a started pair whose ``Z0`` stays in the LoRA branch (see the module docstring): the
    branch adds ``(W_B W_A - Z0 / s) drop(x) * s = (Z - Z0) drop(x)``.  Its buffers sit on the pair's modules (they
    follow the model's ``.to()``; not saved in state dicts): ``lora_A.start_b0t`` = ``B0^T`` (r, n) and
    ``lora_B.start_c0`` = ``-A0 / s`` (m, r).  ``lora_A`` and ``lora_B`` are called as modules (the taps see them);
    the two rank-r products with the start's factors run beside them, in the factors' dtype (float32) under autocast
    too.  Attached as a subclass of PEFT's ``LoraVariant`` (:func:`_variant`: PEFT is imported only where a start
    goes into a branch)."""

    prismdp_rank_r_start = True  # find_lora_pairs accepts this variant: the pair is plain LoRA plus the start

    @staticmethod
    def init(module, adapter_name: str, **kwargs) -> None:
        """Nothing to set up: :class:`StartDropoutCompensation` attaches the variant after the start."""

    @staticmethod
    def forward(module, active_adapter: str, x: Tensor, result: Tensor, **kwargs) -> Tensor:
        lora_A, lora_B = module.lora_A[active_adapter], module.lora_B[active_adapter]
        xd = module.lora_dropout[active_adapter](x)
        with _factor_precision(xd):
            xd = _as(xd, lora_A.weight.dtype)
            h = lora_A(xd)  # W_A drop(x)
            low = _StartProduct.apply(xd, lora_A.start_b0t)  # B0^T drop(x)
            y = _StartProduct.apply(low, lora_B.start_c0, lora_B(h))  # W_B h - (A0 / s) B0^T drop(x)
        return result + y * module.scaling[active_adapter]

    @staticmethod
    def _update(module, adapter: str) -> Tensor:
        """What the layer adds to its base weight: PEFT's ``s W_B W_A`` minus ``Z0``, so that ``merge()`` puts
        ``W0 + Z - Z0`` into the base as it puts ``W0 - Z0 + Z`` there for a pair started in the base."""
        delta = module.get_delta_weight(adapter)
        lora_A, lora_B = module.lora_A[adapter], module.lora_B[adapter]
        dtype = torch.promote_types(delta.dtype, torch.float32)
        z0 = (-module.scaling[adapter] * _as(lora_B.start_c0, dtype)) @ _as(lora_A.start_b0t, dtype)
        if getattr(module, "fan_in_fan_out", False):
            z0 = z0.T
        return delta - z0.to(delta.dtype)

    @staticmethod
    def merge_safe(module, active_adapter: str, orig_weight: Tensor) -> Tensor:
        return orig_weight + StartInBranch._update(module, active_adapter).to(orig_weight.dtype)

    @staticmethod
    def merge_unsafe(module, active_adapter: str, orig_weight: Tensor) -> None:
        orig_weight.data += StartInBranch._update(module, active_adapter).to(orig_weight.dtype)

    @staticmethod
    def unmerge(module, active_adapter: str, orig_weight: Tensor) -> Tensor:
        return orig_weight - StartInBranch._update(module, active_adapter).to(orig_weight.dtype)


@functools.cache
def _variant_class() -> type:
    from peft.tuners.lora.layer import LoraVariant

    return type("StartInBranch", (StartInBranch, LoraVariant), {"__module__": __name__})


def _variant() -> StartInBranch:
    """A :class:`StartInBranch` that is a PEFT ``LoraVariant``."""
    return _variant_class()()


class StartDropoutCompensation:
    """Keeps LoRA dropout off ``Z0`` (see the module docstring) for the started pairs whose dropout is active, and
    keeps ``Z0`` out of a base weight that cannot take it (a quantized one, with or without dropout): their base
    weight keeps ``W0`` and their LoRA branch computes ``(Z - Z0) drop(x)`` itself (:class:`StartInBranch`, PEFT's
    LoRA-variant interface), so the layer is ``W0 x + (Z - Z0) drop(x)`` in train mode and ``(W0 + Z - Z0) x`` in
    eval mode, exactly (no separate ``Z0 (x - drop(x))`` term); PEFT's ``merge()`` puts ``W0 + Z - Z0`` into the
    base.  The pairs' base weights must still hold ``W0`` (:func:`move_to_rank_r_start` leaves them so).

    The branch spends two products of width r beside the LoRA branch's two (``B0^T drop(x)`` and ``-A0/s`` times
    it), the flops any exact form spends.  It replaced forward hooks that added ``Z0 (x - drop(x))`` to the layer's
    output on top of a base holding ``W0 - Z0`` (an elementwise pass over x and a read-modify-write of the output
    more), and a form that switched the class of ``lora_A`` / ``lora_B`` to fuse the products in pairs of width 2r
    (``python -m bench.studies.compensation`` compares the layer's time with and without compensation).
    """

    def __init__(self, pairs: list[LoraPair], factors: list[tuple[Tensor, Tensor]]):
        self.pairs: list[LoraPair] = []
        for pair, (a0, b0) in zip(pairs, factors):
            if _start_in_branch(pair):
                self._attach(pair, a0, b0)
                self.pairs.append(pair)

    @staticmethod
    def _attach(pair: LoraPair, a0: Tensor, b0: Tensor) -> None:
        lora_A, lora_B = pair.lora_A, pair.lora_B
        if type(lora_A) is not nn.Linear or type(lora_B) is not nn.Linear:
            raise LoraSetupError(f"LoRA module {pair.name!r} has lora_A/lora_B of type {type(lora_A).__name__}/"
                                 f"{type(lora_B).__name__}; prismdp's rank-r start with LoRA dropout needs "
                                 "torch.nn.Linear (PEFT's plain LoRA)")
        w = lora_A.weight
        lora_A.register_buffer("start_b0t", b0.T.to(w.device, w.dtype).contiguous(), persistent=False)
        lora_B.register_buffer("start_c0", (-a0 / pair.scaling).to(w.device, w.dtype).contiguous(), persistent=False)
        pair.layer.lora_variant[pair.adapter] = _variant()

    @property
    def active(self) -> bool:
        return bool(self.pairs)

    @torch.no_grad()
    def remove(self) -> None:
        """Back to plain PEFT LoRA on a base holding ``W0 - Z0``: the same model in eval mode, but in train mode the
        dropout then also hits ``Z0 x`` (the ablation ``prism-no-dropout-comp`` of the benchmarks).  Refused for a
        quantized base, whose weight cannot take ``W0 - Z0``."""
        quantized = [pair.name for pair in self.pairs if not frozen.start_in_base(pair.layer.get_base_layer())]
        if quantized:
            raise LoraSetupError(f"LoRA modules {quantized[:3]} sit on a quantized base weight, which cannot hold "
                                 "W0 - Z0: the rank-r start stays in their LoRA branch. Fix: run this ablation on an "
                                 "unquantized base (no --quantize)")
        for pair in self.pairs:
            lora_A, lora_B = pair.lora_A, pair.lora_B
            _write_base_weight(pair, base_weight(pair) - _start_update(pair, torch.float64))  # W0 - Z0
            del pair.layer.lora_variant[pair.adapter]
            for module, buffer in ((lora_A, "start_b0t"), (lora_B, "start_c0")):
                delattr(module, buffer)
        self.pairs = []


@dataclass
class RankRStart:
    """The start point ``Z0 = A0 B0^T`` of every pair, subtracted from its frozen base weight or, for pairs with
    LoRA dropout, by its LoRA branch (``dropout_compensation``)."""

    factors: list[tuple[Tensor, Tensor]]  # per pair: (A0 (m, r), B0 (n, r)), float32
    dropout_compensation: StartDropoutCompensation | None = None

    def state_dict(self) -> dict[str, Tensor]:
        out = {}
        for i, (a0, b0) in enumerate(self.factors):
            out[f"{i}.A0"], out[f"{i}.B0"] = a0, b0
        return out

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> RankRStart:
        n = len(state) // 2
        return cls([(state[f"{i}.A0"], state[f"{i}.B0"]) for i in range(n)])


@torch.no_grad()
def move_to_rank_r_start(
    pairs: list[LoraPair],
    init: str = "spectral",
    init_scale: float = 1e-3,
    generator: torch.Generator | None = None,
) -> RankRStart:
    """Put every pair on the rank-r manifold without changing the model's function.

    ``init="spectral"`` takes ``Z0`` = the top-r SVD part of ``W0`` (PiSSA-style, as the paper's code);
    ``init="random"`` takes a random rank-r ``Z0`` with all singular values ``init_scale * ||W0||_2``.
    In both cases the factors are balanced (``A0^T A0 = B0^T B0``) and ``Z0`` is taken out of the layer again:
    without LoRA dropout from the base weight (``W0 <- W0 - Z0``, so ``W0 + Z`` is unchanged at step 0 up to float
    rounding of the subtraction); with LoRA dropout from the LoRA branch, which then computes ``(Z - Z0) drop(x)``
    on the unchanged ``W0`` (:class:`StartDropoutCompensation`, ``RankRStart.dropout_compensation``), so that in
    train mode too the model computes ``W0 x + (Z - Z0) drop(x)``.  A quantized base weight is never rewritten:
    ``Z0`` is computed from the de-quantized ``W0`` (one layer at a time) and subtracted by the LoRA branch, dropout
    or not.
    """
    if init not in ("spectral", "random"):
        raise ValueError(f"init must be 'spectral' or 'random', got {init!r}")
    factors, exact = [], []  # float32 for the record, float64 for the compensated branches
    for pair in pairs:
        m, n, r = pair.shape
        W0 = base_weight(pair)  # float64, de-quantized or gathered (FSDP): one layer's copy, freed each iteration
        U, S, V = _top_svd(W0, r)
        if init == "spectral":
            A0, B0 = U * S.sqrt(), V * S.sqrt()
        else:
            qa, _ = torch.linalg.qr(torch.randn(m, r, generator=generator, dtype=torch.float64).to(W0.device))
            qb, _ = torch.linalg.qr(torch.randn(n, r, generator=generator, dtype=torch.float64).to(W0.device))
            root = math.sqrt(init_scale * float(S[0]))
            A0, B0 = qa * root, qb * root
        if bool((pair.lora_B.weight != 0).any()) and bool((pair.lora_A.weight != 0).any()):
            raise LoraSetupError(
                f"LoRA module {pair.name!r} already holds a non-zero update; prismdp starts from PEFT's zero "
                "initialisation. Fix: create the adapter with init_lora_weights=True (the default), or merge the "
                "existing adapter into the base model first (model.merge_and_unload())."
            )
        if not _start_in_branch(pair):  # with dropout or a quantized W0, the LoRA branch subtracts Z0 (see above)
            _write_base_weight(pair, W0 - A0 @ B0.T)
        A0, B0 = geometry.balance(A0, B0)
        set_factors(pair, A0.to(pair.lora_B.weight.dtype), B0.to(pair.lora_A.weight.dtype))
        factors.append((A0.float(), (B0.float())))
        exact.append((A0, B0))
        del W0, U, S, V
    return RankRStart(factors, StartDropoutCompensation(pairs, exact))
