"""The GPU benchmark's training-step variants (:mod:`bench.gpu`), each one logical step of the shape's batch as
micro-batches of a size chosen per call:

* ``reference``       what a user would pick instead: PEFT LoRA + ``torch.optim.AdamW``, the model's own loss
                      (``labels=``, a token mean per micro-batch), gradient accumulation.
* ``no-dp``           ``prismdp train --no-dp``: ``make_private(method="prism")`` without noise (PRISM's geometry).
* ``dp-adamw``        prismdp's factor-space DP-AdamW.
* ``prism``           prismdp's PRISM (LoRA dropout 0, as every variant but the next).
* ``prism-dropout``   PRISM with LoRA dropout 0.05 (its rank-r start's dropout compensation active).
* ``prism-householder`` PRISM with ``qr="householder"``: ``torch.linalg.qr`` for its frames and retraction, as before
                      shifted CholeskyQR2 became the CUDA default (:func:`prismdp.geometry.default_qr`); the same
                      as ``prism`` on the CPU.
* ``prism-eager-loss`` PRISM with the chunked eager cross-entropy (``causal_lm_losses(..., fused=False)``), as before
                      the compiled one became the CUDA default; the same as ``prism`` on the CPU.
* ``prism-summed-grads`` PRISM with autograd also computing the LoRA factors' batch-summed ``.grad`` in the recorded
                      backward pass (``GradSampler.summed_lora_grads``), as before 2026-11-27.
* ``prism-tf32-products`` / ``prism-bf16-products`` PRISM with the per-example products in TF32 or bf16 inputs,
                      float32 accumulation (``GradSampler.products``; on the CPU an exact emulation, slower).
* ``prism-secure``    PRISM with ``--secure-noise`` (ChaCha20 on the CPU, the next step's noise drawn in the
                      background while the step runs; issue 44's target: within 1.05x of ``prism``).
* ``opacus-dp-adamw`` Opacus' DP-AdamW: ``PrivacyEngine.make_private`` (hooks) around the same PEFT model,
                      micro-batches as virtual steps (``signal_skip_step``), as ``bench.workloads`` builds it.

prismdp's variants run its engine as ``prismdp train`` does: ``train.step.backward_micro_batches`` over
``micro_batch_plan``, per-example losses from ``prismdp.losses.causal_lm_losses``, then ``PrivateLoRA.queue_step``
and the step's one host read of its loss and statistics, where the training loop reads them (``train/loop.py``: after
the optimizer step is queued, :class:`prismdp.engine.StepReport`); the loss read is kept as ``Variant.loss`` (the
logical batch's mean per-example loss).
Noise multiplier 1 and clipping norm 1 (the cost does not depend on them).

The variants share one copy of the frozen base weights (``copy.deepcopy`` with a memo of the shared tensors) except
those a variant changes: PRISM without dropout moves ``W0 - Z0`` into its target weights, so it gets its own.  A
shared tensor changed in place would corrupt the other variants: its version counter is checked after each build
and each step (:meth:`Variant.check_shared`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from torch import Tensor, nn

from .gpu_models import Shape


@dataclass(frozen=True)
class Spec:
    kind: str  # "reference" | "prismdp" | "opacus"
    method: str | None = None
    dp: bool = True
    dropout: float = 0.0
    qr: str | None = None  # PRISM's thin QR (None: its default for the device)
    fused_loss: bool | None = None  # causal_lm_losses(fused=...) (None: its default for the device)
    summed_grads: bool = False  # GradSampler.summed_lora_grads
    products: str = "float32"  # GradSampler.products
    secure: bool = False  # make_private(secure_noise=True)


SPECS: Dict[str, Spec] = {
    "reference": Spec("reference"),
    "no-dp": Spec("prismdp", "prism", dp=False),
    "dp-adamw": Spec("prismdp", "dp-adamw"),
    "prism": Spec("prismdp", "prism"),
    "prism-dropout": Spec("prismdp", "prism", dropout=0.05),
    "prism-householder": Spec("prismdp", "prism", qr="householder"),
    "prism-eager-loss": Spec("prismdp", "prism", fused_loss=False),
    "prism-summed-grads": Spec("prismdp", "prism", summed_grads=True),
    "prism-tf32-products": Spec("prismdp", "prism", products="tf32"),
    "prism-bf16-products": Spec("prismdp", "prism", products="bf16"),
    "prism-secure": Spec("prismdp", "prism", secure=True),
    "opacus-dp-adamw": Spec("opacus"),
}
VARIANTS = tuple(SPECS)
LR = 1e-4


def changes_base(spec: Spec) -> bool:
    """Does building this variant write into its target modules' frozen weights?  (The rank-r start without LoRA
    dropout moves ``Z0`` out of ``W0``; with dropout the LoRA branch subtracts it instead.)"""
    from prismdp.engine import METHODS

    return spec.kind == "prismdp" and METHODS[spec.method].rank_r_start and spec.dropout == 0


def frozen_copy(base: nn.Module, shape: Shape, own_targets: bool) -> tuple[nn.Module, Dict[int, tuple]]:
    """A copy of ``base`` sharing its tensors (``own_targets``: except the target modules' weights); returns the
    copy and ``{id: (tensor, version)}`` of the shared tensors."""
    own = {id(m.weight) for name, m in base.named_modules()
           if own_targets and name.split(".")[-1] in shape.targets and isinstance(m, nn.Linear)}
    tensors = [*base.parameters(), *base.buffers()]
    memo = {id(t): t for t in tensors if id(t) not in own}
    shared = {i: (t, t._version) for i, t in memo.items()}
    return copy.deepcopy(base, memo), shared


def batch(shape: Shape, vocab: int, device, seed: int = 0) -> Tensor:
    """The shape's logical batch of random token ids (every variant trains on the same), on ``device``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (shape.batch, shape.seq_len), generator=g).to(device)


@dataclass
class Variant:
    """A built variant: ``step(micro)`` runs one logical step as micro-batches of ``micro``."""

    name: str
    model: nn.Module | None
    run: Callable[[int], float | None] | None
    shared: Dict[int, tuple]
    loss: float | None = None  # the last step's loss as read to the host (prismdp variants)

    def step(self, micro: int) -> None:
        self.loss = self.run(micro)

    def check_shared(self) -> None:
        changed = [i for i, (t, v) in self.shared.items() if t._version != v]
        if changed:
            raise RuntimeError(f"variant {self.name!r} changed {len(changed)} frozen tensor(s) shared with the other "
                               "variants; give it its own copy (bench.gpu_variants.changes_base)")

    def release(self) -> None:
        """Drop the model, optimizer and step (after an out-of-memory error: frees what only it holds)."""
        self.model = self.run = None


def _peft(frozen: nn.Module, shape: Shape, dropout: float) -> nn.Module:
    from prismdp.train.build import build_lora_model
    from prismdp.train.config import TrainConfig

    cfg = TrainConfig(rank=shape.rank, alpha=shape.rank, dropout=dropout, target_modules=list(shape.targets))
    model = build_lora_model(cfg, frozen, "causal_lm")[0]
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    if not lora or any(p.dtype != torch.float32 for p in lora):
        raise RuntimeError("the LoRA factors must be float32 trainables on the bf16 base")
    return model.train()


def _micro_slices(n: int, micro: int) -> List[slice]:
    if n % micro:
        raise ValueError(f"micro-batch {micro} does not divide the logical batch {n}")
    return [slice(i, i + micro) for i in range(0, n, micro)]


def _reference(model: nn.Module, ids: Tensor, mask: Tensor) -> Callable[[int], None]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    def run(micro: int) -> None:
        parts = _micro_slices(len(ids), micro)
        for s in parts:
            out = model(input_ids=ids[s], attention_mask=mask[s], labels=ids[s])
            (out.loss / len(parts)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def _prismdp(model: nn.Module, ids: Tensor, mask: Tensor, spec: Spec) -> Callable[[int], None]:
    from prismdp.engine import make_private
    from prismdp.losses import causal_lm_losses
    from prismdp.train.step import backward_micro_batches, micro_batch_plan

    n = len(ids)
    private = make_private(model, method=spec.method, lr=LR, dataset_size=10 * n, batch_size=n, steps=10_000,
                           noise_multiplier=1.0 if spec.dp else None, max_grad_norm=1.0,
                           **({"secure_noise": True, "seed": None} if spec.secure else {"seed": 0}),
                           **({"qr": spec.qr} if spec.qr else {}))
    if spec.summed_grads:
        private.grad_sampler.summed_lora_grads = True
    private.grad_sampler.products = spec.products

    def losses_of(micro: list[int]) -> Tensor:
        s = slice(micro[0], micro[0] + len(micro))
        if micro != list(range(s.start, s.stop)):  # the plan keeps the batch's order (group_by_length off)
            raise RuntimeError(f"expected a consecutive micro-batch, got {micro}")
        return causal_lm_losses(model(input_ids=ids[s], attention_mask=mask[s]).logits, ids[s], fused=spec.fused_loss)

    def run(micro: int) -> float:
        totals = backward_micro_batches(private, micro_batch_plan(range(n), None, micro, group_by_length=False),
                                        losses_of)
        return private.queue_step(totals).read()["loss"]  # read where train/loop.py reads: after the step is queued

    return run


def _opacus(model: nn.Module, ids: Tensor, mask: Tensor) -> Callable[[int], None]:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from prismdp.losses import causal_lm_losses

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    loader = DataLoader(TensorDataset(torch.zeros(10 * len(ids))), batch_size=len(ids))
    gsm, dp_opt, _ = PrivacyEngine(accountant="prv").make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode="hooks")

    def run(micro: int) -> None:
        parts = _micro_slices(len(ids), micro)
        for i, s in enumerate(parts):
            causal_lm_losses(gsm(input_ids=ids[s], attention_mask=mask[s]).logits, ids[s]).mean().backward()
            dp_opt.signal_skip_step(do_skip=i < len(parts) - 1)  # virtual steps: clip and accumulate, update once
            dp_opt.step()
            dp_opt.zero_grad(set_to_none=True)

    return run


def build_variant(name: str, shape: Shape, base: nn.Module, ids: Tensor) -> Variant:
    """Variant ``name`` on a copy of ``base`` (sharing its frozen tensors where it leaves them unchanged), training
    on ``ids`` (the labels are the ids; the attention mask is all ones)."""
    if name not in SPECS:
        raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")
    spec = SPECS[name]
    torch.manual_seed(0)
    frozen, shared = frozen_copy(base, shape, own_targets=changes_base(spec))
    model = _peft(frozen, shape, spec.dropout)
    mask = torch.ones_like(ids)
    if spec.kind == "reference":
        run = _reference(model, ids, mask)
    elif spec.kind == "prismdp":
        run = _prismdp(model, ids, mask, spec)
    else:
        run = _opacus(model, ids, mask)
    variant = Variant(name, model, run, shared)
    variant.check_shared()
    return variant
