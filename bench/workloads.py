"""Benchmark workloads (a frozen base model + LoRA targets + a batch shape) and the training-step variants timed on
them.  Every variant runs one *logical* step: ``batch`` examples as ``batch // micro`` micro-batches of ``micro``,
fixed length ``seq_len`` (random token ids, full attention mask), then one optimizer update.

Variants (:func:`available_variants`; the default run is :data:`VARIANTS`):

* ``lora-adamw``      non-private LoRA: PEFT + ``torch.optim.AdamW``, mean loss, gradient accumulation.
* ``lora-adamw-own-loss`` the same with the model's own loss (``model(..., labels=labels).loss``) instead of
                      prismdp's per-example losses: what a user of plain PEFT runs (issue 30's reference).
* every method registered in :data:`prismdp.engine.METHODS` (``make_private(method=...)``), e.g. ``dp-adamw``
                      (prismdp's factor-space DP-AdamW) and ``prism``.
* ``prism-no-dropout-comp`` (opt-in ablation, not in the default run) PRISM without what keeps LoRA dropout off the
                      rank-r start (``prismdp.lora.start.StartDropoutCompensation``, removed: plain LoRA on a base holding
                      ``W0 - Z0``, not exact in train mode): its cost.
* ``prism-secure``, ``dp-adamw-secure`` (opt-in) the same with ``secure_noise=True``: noise and Poisson
                      inclusions from OS-keyed ChaCha20, noise as Holohan-Braghin sums of four normals
                      (:mod:`prismdp.privacy.secure`).
* ``prism-bf16``, ``prism-ckpt``, ``prism-bf16-ckpt`` (opt-in, issue 12; :mod:`bench.studies.scaling`) PRISM with
                      the frozen base model in bfloat16 (LoRA factors float32, as ``prismdp train --dtype
                      bfloat16``) and/or transformers' gradient checkpointing (``--gradient-checkpointing``,
                      non-re-entrant).
* ``prism-summed-grads`` (opt-in) PRISM with autograd also computing the LoRA factors' batch-summed ``.grad`` during
                      the recorded backward pass (``GradSampler.summed_lora_grads``), as before 2026-11-27: what
                      skipping those products gains.
* ``opacus-dp-adamw`` Opacus' own DP-AdamW: ``PrivacyEngine.make_private`` (hooks mode) around the same PEFT
                      model, micro-batches as Opacus' virtual steps (``signal_skip_step``), as BatchMemoryManager
                      does.

The private variants use a fixed noise multiplier (1.0) and clipping norm 1.0: the cost does not depend on them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch
from torch import nn

OWN_LOSS = "lora-adamw-own-loss"  # plain PEFT LoRA + AdamW with the model's own loss (issue 30)
# not prismdp methods: the non-private and Opacus baselines
REFERENCES = ("lora-adamw", "opacus-dp-adamw", OWN_LOSS)
VARIANTS = ("lora-adamw", "dp-adamw", "prism", "opacus-dp-adamw", OWN_LOSS)  # the default run
# selectable with --variants, not run by default: a registered method with one thing changed
ABLATIONS = {"prism-no-dropout-comp": "prism", "prism-secure": "prism", "dp-adamw-secure": "dp-adamw",
             "prism-bf16": "prism", "prism-ckpt": "prism", "prism-bf16-ckpt": "prism", "prism-summed-grads": "prism"}


def available_variants() -> tuple[str, ...]:
    """Every variant ``build_variant`` knows: the references, every registered method, the ablations."""
    from prismdp.engine import METHODS

    return (*REFERENCES, *METHODS, *ABLATIONS)


@dataclass
class Workload:
    name: str
    description: str
    task_type: str  # "seq_cls" | "causal_lm"
    targets: List[str]
    batch: int
    micro: int
    seq_len: int
    rank: int = 16
    load: Callable[[], nn.Module] = field(default=None, repr=False)  # frozen base model, eval-mode weights

    @property
    def n_micro(self) -> int:
        return self.batch // self.micro


def _load_minilm() -> nn.Module:
    from prismdp.models import load_model

    return load_model(None, "seq_cls", num_labels=2)[0]


def _load_smollm2() -> nn.Module:
    from prismdp.models import load_model

    return load_model(None, "causal_lm")[0]


def _tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2)
    return BertForSequenceClassification(cfg)


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


WORKLOADS: Dict[str, Workload] = {
    "W1": Workload("W1", "packaged MiniLM-L6 sequence classifier, LoRA r 16 on query/key/value, batch 32 as 8 x 4, "
                   "length 128", "seq_cls", ["query", "key", "value"], 32, 4, 128, load=_load_minilm),
    "W2": Workload("W2", "packaged SmolLM2-135M causal LM, LoRA r 16 on q/k/v/up/down_proj, batch 8 as 2 x 4, "
                   "length 128", "causal_lm", ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"], 8, 4, 128,
                   load=_load_smollm2),
    # tiny random-init stand-ins (the test suite checks the runner's bookkeeping on these)
    "tiny-bert": Workload("tiny-bert", "tiny random BERT, LoRA r 4 on query/value, batch 8 as 2 x 4, length 16",
                          "seq_cls", ["query", "value"], 8, 4, 16, rank=4, load=_tiny_bert),
    "tiny-llama": Workload("tiny-llama", "tiny random Llama, LoRA r 4 on q/v/up/down, batch 8 as 2 x 4, length 16",
                           "causal_lm", ["q_proj", "v_proj", "up_proj", "down_proj"], 8, 4, 16, rank=4,
                           load=_tiny_llama),
}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time (meaningful at 1 thread)


class Timer:
    """Accumulated time (``clock``: wall or this process's CPU time) of the calls made through :meth:`call` (the
    mechanism's share of a step); with ``count_syncs`` set, also the host synchronisations inside them."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds = 0.0
        self.count_syncs = False
        self.syncs = 0

    def call(self, fn, *args, **kwargs):
        from .micro import HostSyncCounter

        t0 = self.clock()
        try:
            if not self.count_syncs:
                return fn(*args, **kwargs)
            with HostSyncCounter() as counter:
                out = fn(*args, **kwargs)
            self.syncs += counter.count
            return out
        finally:
            self.seconds += self.clock() - t0


class TimedOptimizer:
    """A private run's optimizer with its ``accumulate()`` and ``step()`` (the DP mechanism: clip, noise, update)
    timed; everything else is the optimizer's own.  Put in by composition (``dataclasses.replace(private,
    optimizer=...)``), so the optimizer itself is never patched."""

    def __init__(self, optimizer, timer: Timer):
        self.optimizer, self.timer = optimizer, timer

    def accumulate(self, grads):
        return self.timer.call(self.optimizer.accumulate, grads)

    def step(self, closure=None):
        return self.timer.call(self.optimizer.step, closure)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


@dataclass
class Variant:
    """One training-step variant: ``parts`` are its step in order (each micro-batch's forward and backward, then the
    update), so that a benchmark can interleave variants micro-batch by micro-batch (``step()`` runs them all)."""

    name: str
    parts: List[Callable[[], None]]
    mechanism: Timer | None = None  # time inside the DP mechanism (clip, noise, update), None if not private

    def step(self) -> None:
        for part in self.parts:
            part()


def _batches(w: Workload, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (w.n_micro, w.micro, w.seq_len), generator=g)
    mask = torch.ones_like(ids)
    if w.task_type == "seq_cls":
        labels = torch.randint(0, 2, (w.n_micro, w.micro), generator=g)
    else:
        labels = ids.clone()
    return [(ids[i], mask[i], labels[i]) for i in range(w.n_micro)]


def _peft(base: nn.Module, w: Workload, dtype: torch.dtype | None = None) -> nn.Module:
    from prismdp.train.build import build_lora_model
    from prismdp.train.config import TrainConfig

    cfg = TrainConfig(rank=w.rank, alpha=w.rank, dropout=0.05, target_modules=w.targets)
    frozen = copy.deepcopy(base)
    if dtype is not None:  # the base cast before PEFT wraps it: the LoRA factors are created float32
        frozen = frozen.to(dtype)
    model = build_lora_model(cfg, frozen, w.task_type)[0]
    model.train()
    return model


def _per_example_losses(w: Workload, model, ids, mask, labels):
    from prismdp.losses import causal_lm_losses, classification_losses

    logits = model(input_ids=ids, attention_mask=mask).logits
    if w.task_type == "seq_cls":
        return classification_losses(logits, labels)
    return causal_lm_losses(logits, labels)


def build_variant(name: str, w: Workload, base: nn.Module, shard: tuple[int, int] = (0, 1),
                  clock: Callable[[], float] = time.perf_counter) -> Variant:
    """A fresh PEFT copy of ``base`` set up for variant ``name``, with its step function.  ``shard = (rank, size)``:
    a private variant's step runs the micro-batches ``rank, rank + size, ...`` of the logical batch (one process of a
    multi-process run, :mod:`bench.studies.scaling`); ``clock`` times its mechanism."""
    if name not in available_variants():
        raise ValueError(f"unknown variant {name!r}; choose from {available_variants()}")
    torch.manual_seed(0)
    model = _peft(base, w, torch.bfloat16 if "bf16" in name else None)
    if name.endswith("-ckpt"):
        from prismdp.models import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    vocab = model.get_input_embeddings().num_embeddings
    data = _batches(w, vocab)

    if name in ("lora-adamw", OWN_LOSS):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def micro(ids, mask, labels):
            if name == OWN_LOSS:
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            else:
                loss = _per_example_losses(w, model, ids, mask, labels).mean()
            (loss / w.n_micro).backward()

        def update():
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Variant(name, [functools.partial(micro, *b) for b in data] + [update])

    if name not in REFERENCES:  # a registered method, or an ablation of one
        from prismdp.engine import make_private

        method = ABLATIONS.get(name, name)
        secure = name.endswith("-secure")
        private = make_private(model, method=method, lr=1e-4, dataset_size=10 * w.batch, batch_size=w.batch,
                               steps=10 ** 6, noise_multiplier=1.0, max_grad_norm=1.0, seed=None if secure else 0,
                               secure_noise=secure)
        if name == "prism-no-dropout-comp":
            private.start.dropout_compensation.remove()
        if name == "prism-summed-grads":
            private.grad_sampler.summed_lora_grads = True
        timer = Timer(clock)
        private = dataclasses.replace(private, optimizer=TimedOptimizer(private.optimizer, timer))

        mine = data[shard[0]::shard[1]]

        def micro(ids, mask, labels):
            private.backward(_per_example_losses(w, model, ids, mask, labels))

        return Variant(name, [functools.partial(micro, *b) for b in mine] + [private.step], timer)

    # Opacus' own DP-AdamW on the same PEFT model
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    loader = DataLoader(TensorDataset(torch.zeros(10 * w.batch)), batch_size=w.batch)
    engine = PrivacyEngine(accountant="prv")
    gsm, dp_opt, _ = engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                         max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="hooks")
    timer = Timer(clock)

    def micro(i, ids, mask, labels):
        _per_example_losses(w, gsm, ids, mask, labels).mean().backward()
        dp_opt.signal_skip_step(do_skip=i < w.n_micro - 1)  # virtual steps: clip and accumulate, update once
        timer.call(dp_opt.step)
        dp_opt.zero_grad(set_to_none=True)

    return Variant(name, [functools.partial(micro, i, *b) for i, b in enumerate(data)], timer)
