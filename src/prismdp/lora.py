"""PEFT LoRA pairs as points on the rank-r manifold.

For one PEFT ``lora.Linear`` module with frozen ``W0`` (m x n), ``lora_A.weight`` ``W_A`` (r x n),
``lora_B.weight`` ``W_B`` (m x r) and ``scaling`` s, the intrinsic parameter is the weight delta
``Z = s W_B W_A``.  We use the symmetric split ``A = sqrt(s) W_B`` (m x r), ``B = sqrt(s) W_A^T`` (n x r),
so ``Z = A B^T`` and the factor gradients are ``gA = dL/dW_B / sqrt(s)``, ``gB = (dL/dW_A)^T / sqrt(s)``.

PEFT initialises ``W_B = 0`` (Z = 0, off the rank-r manifold).  :func:`move_to_rank_r_start` picks a rank-r
point ``Z0`` with balanced factors and subtracts it from the frozen base weight, so the model computes the same
function as before while the trainable point sits on the manifold.  :class:`RankRStart` records ``Z0`` so the
trained adapter can be exported for the *original* base weights (``Z - Z0`` has rank <= 2r).

LoRA dropout: PEFT computes ``W0' x + Z drop(x)``.  With ``W0' = W0 - Z0`` that would also drop inputs of ``Z0 x``,
a slice of the pretrained weight (its top-r part with the spectral start) rather than of the learned update, and the
train-mode model would not be the model being fine-tuned (measured on SmolLM2-135M, dropout 0.05 on
q/k/v/up/down: the first-batch loss rises from 1.79 to 2.19 and PRISM's training loss swings up to 4.2).
For layers with LoRA dropout :func:`move_to_rank_r_start` therefore leaves ``W0`` in the base and lets the LoRA
branch subtract ``Z0`` itself (:class:`StartDropoutCompensation`), so the layer computes ``W0 x + (Z - Z0) drop(x)``:
ordinary LoRA dropout on the update, which is also what the exported rank-2r adapter computes on the original base.

Quantized base (QLoRA: PEFT's bitsandbytes LoRA layers ``Linear4bit`` / ``Linear8bitLt``, or a LoRA ``Linear`` whose
base weight is a torchao ``NF4Tensor``, sharded or not: :mod:`prismdp.quantized`): the base weight is stored
in 4 or 8 bits and must never be rewritten (``W0 - Z0`` re-quantized would change the model by a new quantization
error, and the quantized storage has no room for the update).  The start is computed from the *de-quantized* ``W0``
(what the layer actually multiplies by), one layer at a time, so the peak memory is one layer's float copy, never the
model's; and ``Z0`` is always kept in the LoRA branch (:class:`StartDropoutCompensation`, with or without dropout):
the layer computes ``Q(W0) x + (Z - Z0) drop(x)``, the same function as before the start.  The per-example taps sit
on ``lora_A`` / ``lora_B`` (plain ``nn.Linear`` in every PEFT LoRA layer), whose input is the layer's input: the
quantized weight never enters the per-example gradients.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from . import base as frozen
from . import geometry

__all__ = [
    "LoraPair",
    "LoraSetupError",
    "find_lora_pairs",
    "freeze_lora_A",
    "get_factors",
    "set_factors",
    "RankRStart",
    "StartDropoutCompensation",
    "move_to_rank_r_start",
    "quantized_base",
    "base_weight",
]


class LoraSetupError(ValueError):
    """The model's LoRA configuration cannot be trained by prismdp as it is."""


@dataclass(frozen=True)
class LoraPair:
    """One LoRA module: where it lives and how its factors map to ``Z = A B^T``."""

    name: str
    layer: nn.Module  # the peft lora.Linear wrapper
    adapter: str
    trainable: str = "both"  # "both" factors, or "B" only (lora_A frozen, e.g. FFA-LoRA)

    @property
    def lora_A(self) -> nn.Linear:  # W_A: (r, n)
        return self.layer.lora_A[self.adapter]

    @property
    def lora_B(self) -> nn.Linear:  # W_B: (m, r)
        return self.layer.lora_B[self.adapter]

    @property
    def scaling(self) -> float:
        return float(self.layer.scaling[self.adapter])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(m, n, r)."""
        r, n = self.lora_A.weight.shape
        return self.lora_B.weight.shape[0], n, r

    @property
    def params(self) -> tuple[nn.Parameter, nn.Parameter]:
        return self.lora_A.weight, self.lora_B.weight

    @property
    def trains_A(self) -> bool:
        return self.trainable == "both"

    @property
    def trained_params(self) -> tuple[nn.Parameter, ...]:
        """The trained factors in :class:`~prismdp.grad_sample.PerExampleGrads` order: (lora_B[, lora_A])."""
        return (self.lora_B.weight, self.lora_A.weight) if self.trains_A else (self.lora_B.weight,)


_BNB_LORA = ("Linear4bit", "Linear8bitLt")  # PEFT's LoRA layers on bitsandbytes' quantized Linear layers


def _is_lora_linear(module: nn.Module) -> bool:
    """PEFT's LoRA ``Linear``, or its bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` (matched by class, without
    importing bitsandbytes where no model uses it)."""
    from peft.tuners.lora.layer import Linear

    cls = type(module)
    return isinstance(module, Linear) or (cls.__module__ == "peft.tuners.lora.bnb" and cls.__name__ in _BNB_LORA)


def quantized_base(pair: LoraPair) -> str | None:
    """``"4bit"`` / ``"8bit"`` where the pair's base layer holds a bitsandbytes-quantized weight, ``"nf4"`` where it
    holds a torchao ``NF4Tensor`` (sharded or not), else None (:func:`prismdp.base.storage_name`)."""
    name = frozen.storage_name(pair.layer.get_base_layer())
    return None if name == "float" else name


def freeze_lora_A(model: nn.Module, adapter: str = "default") -> None:
    """Freeze every ``lora_A`` factor of ``adapter`` at its current value (FFA-LoRA keeps PEFT's random init)."""
    from peft.tuners.lora.layer import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
            module.lora_A[adapter].weight.requires_grad_(False)


def find_lora_pairs(model: nn.Module, adapter: str = "default", trainable: str = "both") -> list[LoraPair]:
    """All trainable PEFT LoRA ``Linear`` pairs of ``adapter``; validates what prismdp supports.

    ``trainable="both"`` takes the pairs whose two factors are trainable; ``trainable="B"`` the pairs whose
    ``lora_B`` is trainable and whose ``lora_A`` is frozen (call :func:`freeze_lora_A` first), as FFA-LoRA trains.

    Raises :class:`LoraSetupError` (naming the module and the fix) for LoRA layers of other types
    (embedding, conv, ...), DoRA / other variants, LoRA biases, r >= min(m, n), a trainable ``lora_A`` with
    ``trainable="B"``, or no pair at all.
    """
    from peft.tuners.lora.layer import LoraLayer

    if trainable not in ("both", "B"):
        raise ValueError(f"trainable must be 'both' or 'B', got {trainable!r}")

    pairs: list[LoraPair] = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in getattr(module, "r", {}):
            continue
        if not _is_lora_linear(module):
            raise LoraSetupError(
                f"LoRA module {name!r} is a {type(module).__name__}; prismdp supports LoRA on Linear layers only. "
                "Fix: restrict target_modules to linear projections (e.g. q_proj, v_proj)."
            )
        if adapter in getattr(module, "lora_variant", {}):
            raise LoraSetupError(
                f"LoRA module {name!r} uses a LoRA variant (e.g. DoRA); prismdp supports plain LoRA only. "
                "Fix: create the LoraConfig with use_dora=False."
            )
        pair = LoraPair(name, module, adapter, trainable)
        if pair.lora_A.bias is not None or pair.lora_B.bias is not None:
            raise LoraSetupError(
                f"LoRA module {name!r} has a LoRA bias; the rank-r manifold has no bias term. "
                "Fix: create the LoraConfig with lora_bias=False."
            )
        wa, wb = pair.params
        if trainable == "B" and wb.requires_grad and wa.requires_grad:
            raise LoraSetupError(
                f"LoRA module {name!r} has a trainable lora_A, but only lora_B is trained here; its gradient "
                "would escape the privacy guarantee. Fix: call prismdp.lora.freeze_lora_A(model) first."
            )
        if not (wb.requires_grad and (wa.requires_grad or trainable == "B")):
            continue
        m, n, r = pair.shape
        if r >= min(m, n):
            raise LoraSetupError(
                f"LoRA module {name!r} has rank r={r} >= min(out={m}, in={n}): the fixed-rank manifold is "
                "degenerate there. Fix: choose r < min(in_features, out_features) or exclude this module."
            )
        pairs.append(pair)
    if not pairs:
        raise LoraSetupError(
            f"no trainable LoRA Linear pairs for adapter {adapter!r} were found in the model. Fix: wrap the "
            "model with peft.get_peft_model(model, LoraConfig(target_modules=[...])) before building the optimizer."
        )
    return pairs


def stack_by_shape(pairs: list[LoraPair]) -> list[list[int]]:
    """Indices of the pairs with equal (m, n, r, scaling, trained factors, dtype, device), in order of first
    appearance: per-example gradients and PRISM's geometry process each such *stack* as one batched tensor."""
    stacks: dict[tuple, list[int]] = {}
    for k, pair in enumerate(pairs):
        w = pair.lora_A.weight
        stacks.setdefault((pair.shape, pair.scaling, pair.trains_A, w.dtype, w.device), []).append(k)
    return list(stacks.values())


@torch.no_grad()
def get_factors(pair: LoraPair, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(A, B)`` = ``(sqrt(s) W_B, sqrt(s) W_A^T)`` with shapes (m, r), (n, r)."""
    root = math.sqrt(pair.scaling)
    wa, wb = pair.params
    dtype = dtype or wb.dtype
    return wb.to(dtype) * root, wa.T.to(dtype) * root


@torch.no_grad()
def set_factors(pair: LoraPair, A: Tensor, B: Tensor) -> None:
    """Write ``(A, B)`` back into ``(lora_B.weight, lora_A.weight)``."""
    inv_root = 1.0 / math.sqrt(pair.scaling)
    wa, wb = pair.params
    wb.copy_(A * inv_root)
    wa.copy_(B.T * inv_root)


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


class _StartedProject(torch.autograd.Function):
    """``(h, low) = (W_A xd, B0^T xd)`` from one (.., 2r) product ``xd [W_A; B0^T]^T``.  The backward takes the two
    output gradients as one (.., 2r) product again (``dxd = [dh, dlow] [W_A; B0^T]``) and forms only ``dW_A = dh^T xd``
    (autograd through a concatenated weight would also form the unused ``dlow^T xd``).  Autograd casts each returned
    gradient to its input's dtype."""

    @staticmethod
    def forward(ctx, xd: Tensor, wa: Tensor, b0t: Tensor) -> tuple[Tensor, Tensor]:
        with _factor_precision(xd):
            w = torch.cat([wa, b0t])  # (2r, n)
            xd = _as(xd, w.dtype)
            u = F.linear(xd, w)
        ctx.save_for_backward(xd, w)
        r = wa.shape[0]
        h, low = u[..., :r], u[..., r:]
        if not xd.requires_grad:  # nothing flows back through B0^T xd: its product in lora_B's backward is skipped
            ctx.mark_non_differentiable(low)
        return h, low

    @staticmethod
    def backward(ctx, dh: Tensor, dlow: Tensor):
        xd, w = ctx.saved_tensors
        dxd = dwa = None
        with _factor_precision(xd):
            dh = _as(dh, w.dtype)
            if ctx.needs_input_grad[0]:
                dxd = torch.cat([dh, _as(dlow, w.dtype)], -1) @ w
            if ctx.needs_input_grad[1]:
                dwa = dh.reshape(-1, dh.shape[-1]).T @ xd.reshape(-1, xd.shape[-1])
        return dxd, dwa, None


class _StartedCombine(torch.autograd.Function):
    """``y = W_B h + C0 low`` (``C0 = -A0 / s``) as one (.., 2r) x (2r, m) product; the backward forms
    ``[dh, dlow] = dy [W_B, C0]`` as one product (``dlow`` only where it flows on) and ``dW_B = dy^T h``."""

    @staticmethod
    def forward(ctx, h: Tensor, low: Tensor, wb: Tensor, c0: Tensor) -> Tensor:
        with _factor_precision(h):
            w = torch.cat([wb, c0], 1)  # (m, 2r)
            u = _as(torch.cat([h, low], -1), w.dtype)  # (.., 2r)
            y = F.linear(u, w)
        ctx.save_for_backward(u, w)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        u, w = ctx.saved_tensors
        r = w.shape[1] // 2
        dh = dlow = dwb = None
        with _factor_precision(dy):
            dy = _as(dy, w.dtype)
            if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
                wt = w.T.contiguous()  # (2r, m): dy @ w in this layout took 49 instead of 113 us at (256, 384) x (384, 8)
                if ctx.needs_input_grad[1]:
                    du = F.linear(dy, wt)
                    dh, dlow = du[..., :r], du[..., r:]
                else:  # B0^T drop(x) needs no gradient (e.g. the first layer, below nothing trainable)
                    dh = F.linear(dy, wt[:r])
            if ctx.needs_input_grad[2]:
                dwb = dy.reshape(-1, dy.shape[-1]).T @ u[..., :r].reshape(-1, r)
        return dh, dlow, dwb, None


class _StartedLoraA(nn.Linear):
    """``lora_A`` of a started pair with LoRA dropout: returns ``h = W_A drop(x)`` as before and hands
    ``B0^T drop(x)``, computed in the same product, to its ``lora_B`` (:class:`_StartedLoraB`) through ``handoff``.
    Buffer ``start_b0t`` = ``B0^T`` (r, n), not saved in state dicts."""

    def forward(self, x: Tensor) -> Tensor:
        h, low = _StartedProject.apply(x, self.weight, self.start_b0t)
        self.handoff[:] = [low]  # overwritten, never accumulated: a forward cut short leaves nothing behind
        return h


class _StartedLoraB(nn.Linear):
    """``lora_B`` of a started pair with LoRA dropout: ``W_B h - (A0 / s) B0^T drop(x)``, so that PEFT's
    ``scaling * lora_B(..)`` is ``(Z - Z0) drop(x)``.  Buffer ``start_c0`` = ``-A0 / s`` (m, r), not saved."""

    def forward(self, h: Tensor) -> Tensor:
        if not self.handoff:
            raise RuntimeError("the lora_B of a started LoRA pair was called without its lora_A; prismdp's rank-r "
                               "start with LoRA dropout needs PEFT's lora_B(lora_A(dropout(x)))")
        low = self.handoff.pop()
        return _StartedCombine.apply(h, low, self.weight, self.start_c0)


def _start_update(pair: LoraPair, dtype: torch.dtype) -> Tensor:
    """``Z0 = A0 B0^T`` (m, n) of a started pair from its buffers (``start_c0 = -A0 / s``, ``start_b0t = B0^T``)."""
    return (-pair.scaling * _as(pair.lora_B.start_c0, dtype)) @ _as(pair.lora_A.start_b0t, dtype)


class _DeltaMinusStart:
    """``layer.get_delta_weight`` of a started pair with LoRA dropout: PEFT's ``s W_B W_A`` minus ``Z0``, what the
    layer adds to its base weight ``W0``, so that PEFT's ``merge()`` / ``unmerge()`` / ``merge_and_unload()`` put
    ``W0 + Z - Z0`` into the base as they put ``W0 - Z0 + Z`` there without dropout."""

    def __init__(self, pair: LoraPair):
        self.pair = pair

    def __call__(self, adapter: str) -> Tensor:
        layer = self.pair.layer
        delta = type(layer).get_delta_weight(layer, adapter)
        if adapter != self.pair.adapter:
            return delta
        z0 = _start_update(self.pair, torch.promote_types(delta.dtype, torch.float32))
        if getattr(layer, "fan_in_fan_out", False):
            z0 = z0.T
        return delta - z0.to(delta.dtype)


class StartDropoutCompensation:
    """Keeps LoRA dropout off ``Z0`` (see the module docstring) for the started pairs whose dropout is active, and
    keeps ``Z0`` out of a quantized base weight (with or without dropout): their
    base weight keeps ``W0`` and their LoRA branch computes ``(Z - Z0) drop(x)`` itself, so the layer is
    ``W0 x + (Z - Z0) drop(x)`` in train mode and ``(W0 + Z - Z0) x`` in eval mode, exactly (no separate
    ``Z0 (x - drop(x))`` term).  ``lora_A`` and ``lora_B`` of such a pair become :class:`_StartedLoraA` and
    :class:`_StartedLoraB` *in place* (their class is switched): the same module objects, parameters, state-dict
    keys and hooks, so the gradient sampler's taps still see ``drop(x)``, ``h = W_A drop(x)`` and the gradient at
    ``lora_B``'s output.  ``lora_A`` computes ``u = drop(x) [W_A; B0^T]^T`` (.., 2r) and returns its first r columns;
    ``lora_B`` computes ``[h, B0^T drop(x)] [W_B, -A0/s]^T``: two products of width 2r in place of the LoRA branch's
    two of width r, the flops any exact form spends.

    The pairs' base weights must still hold ``W0`` (:func:`move_to_rank_r_start` leaves them so).  The layer's
    ``get_delta_weight`` returns ``Z - Z0`` (:class:`_DeltaMinusStart`), so PEFT's ``merge()`` stays right.

    It replaced forward hooks that added ``Z0 (x - drop(x))`` to the layer's output on top of a base holding
    ``W0 - Z0`` (an elementwise pass over x, two rank-r products forward, a read-modify-write of the output, two
    products and two gradient accumulations over x backward).  Measured on one PEFT layer (forward + backward with the
    gradient sampler's taps, one thread, ``python -m bench.studies.compensation``, three runs each on a shared
    machine), the layer's time over the same layer without compensation went from 1.11-1.14 to 1.04-1.08 at W0's shape
    (384 -> 384, r 4, 8 x 32 tokens), from 1.135-1.14 to 1.07-1.08 at W1's (r 16, 4 x 128) and from 1.07-1.10 to
    1.04-1.05 at W2's up_proj (576 -> 1536, r 16, 4 x 128).
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
        handoff: list[Tensor] = []
        lora_A.__class__, lora_B.__class__ = _StartedLoraA, _StartedLoraB
        lora_A.register_buffer("start_b0t", b0.T.to(w.device, w.dtype).contiguous(), persistent=False)
        lora_B.register_buffer("start_c0", (-a0 / pair.scaling).to(w.device, w.dtype).contiguous(), persistent=False)
        lora_A.handoff = lora_B.handoff = handoff
        pair.layer.get_delta_weight = _DeltaMinusStart(pair)

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
            del pair.layer.get_delta_weight
            for module, buffer in ((lora_A, "start_b0t"), (lora_B, "start_c0")):
                delattr(module, buffer)
                del module.handoff
                module.__class__ = nn.Linear
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
