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
:func:`move_to_rank_r_start` therefore adds ``Z0 (x - drop(x))`` to each layer's train-mode output
(:class:`StartDropoutCompensation`), so the layer computes ``W0 x + (Z - Z0) drop(x)``: ordinary LoRA dropout on the
update, which is also what the exported rank-2r adapter computes on the original base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

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


def _lora_linear_cls():
    from peft.tuners.lora.layer import Linear

    return Linear


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

    linear_cls = _lora_linear_cls()
    pairs: list[LoraPair] = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in getattr(module, "r", {}):
            continue
        if not isinstance(module, linear_cls):
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


def _base_weight(pair: LoraPair) -> tuple[Tensor, bool]:
    base = pair.layer.get_base_layer()
    return base.weight, bool(getattr(pair.layer, "fan_in_fan_out", False))


def _top_svd(W: Tensor, r: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-r singular triplets (U (m, r), S (r,), V (n, r)); randomized for large matrices."""
    if min(W.shape) <= 1024:
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        return U[:, :r], S[:r], Vh[:r].T
    U, S, V = torch.svd_lowrank(W, q=r + 10, niter=4)
    return U[:, :r], S[:r], V[:, :r]


class _Compensate(torch.autograd.Function):
    """``out + Z0 (x - xd)`` with ``Z0 = a0t^T b0t`` (``a0t`` (r, m), ``b0t`` (r, n), both contiguous) as one autograd
    node.  The thin products read the factors in nn.Linear's layout (``x @ b0t^T``): with ``b0`` stored (n, r) instead,
    ``x @ b0`` at r = 4 took 4.4x as long on this CPU (112 vs 25 us for (256, 384) @ (384, 4), one thread), and so did
    the backward's ``g @ a0`` that autograd derived for the unfused form."""

    @staticmethod
    def forward(ctx, out: Tensor, x: Tensor, xd: Tensor, a0t: Tensor, b0t: Tensor) -> Tensor:
        ctx.save_for_backward(a0t, b0t)
        low = (x - xd).reshape(-1, x.shape[-1]) @ b0t.T  # (.., r)
        if out.dtype == a0t.dtype:
            return torch.addmm(out.reshape(-1, out.shape[-1]), low, a0t).view(out.shape)
        return out + (low @ a0t).view(out.shape).to(out.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            return g, None, None, None, None
        a0t, b0t = ctx.saved_tensors
        low = g.reshape(-1, g.shape[-1]).to(a0t.dtype) @ a0t.T  # Z0^T g = b0t^T (a0t g)
        gx = (low @ b0t).view(*g.shape[:-1], b0t.shape[-1])
        return g, gx, -gx, None, None


class StartDropoutCompensation:
    """Forward hooks that keep LoRA dropout off ``Z0`` (see the module docstring): in train mode each layer with
    an active dropout gets ``Z0 (x - drop(x))`` added to its output, where ``x`` and ``drop(x)`` are the input and
    output of the layer's LoRA dropout.  Nothing is added in eval mode, with dropout 0, or when the adapter is
    disabled or merged (the LoRA branch, and with it the dropout, does not run).

    One hook on the dropout keeps ``(x, drop(x))``; one on the layer adds the compensation through
    :class:`_Compensate`, one autograd node whose products read the start factors in the fast layout.  Measured on one
    PEFT layer (forward + backward with the gradient sampler's taps, one thread): at W0's shape (384 -> 384, r 4,
    8 x 32 tokens) the compensation's share of the layer's time fell from 16.9 % (autograd-recorded
    ``(x - drop(x)) @ B0`` then ``addmm``) to 9.6 %; at W2's up_proj (576 -> 1536, r 16, 4 x 128 tokens) it stays
    ~7 %: there the two rank-r products cost what the LoRA branch's own do, flops any exact form must spend."""

    def __init__(self, pairs: list[LoraPair], factors: list[tuple[Tensor, Tensor]]):
        self.handles = []
        for pair, (a0, b0) in zip(pairs, factors):
            drop = pair.layer.lora_dropout[pair.adapter]
            if isinstance(drop, nn.Dropout) and drop.p > 0:
                w = pair.lora_A.weight
                a0t, b0t = (f.to(w.device, w.dtype).T.contiguous() for f in (a0, b0))  # nn.Linear's layout
                self._attach(pair, drop, a0t, b0t)

    def _attach(self, pair: LoraPair, drop: nn.Module, a0t: Tensor, b0t: Tensor) -> None:
        seen: list[tuple[Tensor, Tensor]] = []  # (x, drop(x)) of this forward, x already in the factors' dtype

        def keep_dropout(module, args, output):
            if module.training:
                seen.append((args[0], output))

        def compensate(module, args, output):
            if not seen:
                return None
            x, xd = seen.pop()
            seen.clear()
            if not module.training:
                return None
            return _Compensate.apply(output, x, xd, a0t, b0t)

        self.handles += [drop.register_forward_hook(keep_dropout), pair.layer.register_forward_hook(compensate)]

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@dataclass
class RankRStart:
    """The start point ``Z0 = A0 B0^T`` of every pair, moved out of the frozen base weights."""

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
    In both cases the factors are balanced (``A0^T A0 = B0^T B0``) and ``W0 <- W0 - Z0``, so
    ``W0 + Z`` is unchanged at step 0 (up to float rounding of the subtraction).  Layers with LoRA dropout get a
    :class:`StartDropoutCompensation` (``RankRStart.dropout_compensation``), so that in train mode too the model
    computes ``W0 x + (Z - Z0) drop(x)``.
    """
    if init not in ("spectral", "random"):
        raise ValueError(f"init must be 'spectral' or 'random', got {init!r}")
    factors, exact = [], []  # float32 for the record, float64 for the compensation hooks
    for pair in pairs:
        m, n, r = pair.shape
        weight, transposed = _base_weight(pair)
        W0 = (weight.T if transposed else weight).to(torch.float64)
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
        new_W0 = W0 - A0 @ B0.T
        weight.copy_((new_W0.T if transposed else new_W0).to(weight.dtype))
        A0, B0 = geometry.balance(A0, B0)
        set_factors(pair, A0.to(pair.lora_B.weight.dtype), B0.to(pair.lora_A.weight.dtype))
        factors.append((A0.float(), (B0.float())))
        exact.append((A0, B0))
    return RankRStart(factors, StartDropoutCompensation(pairs, exact))
