"""From a :class:`~prismdp.train.config.TrainConfig` to a ready run: the one place that loads the model and the task
data, puts LoRA on the model and makes it private (``prismdp train``, the diagnostics, the audit and the benchmarks
all build their runs here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from ..base import BaseError, FrozenBase, ShardingError, check_base, prepare_base
from ..distributed import World
from ..engine import METHODS, PrivateLoRA, make_private
from ..models import (enable_gradient_checkpointing, load_model, load_tokenizer, model_skeleton, stored_dtype,
                      whole_read_note)
from ..privacy import check_delta
from .config import ConfigError, TrainConfig
from .tasks import TaskData, build_task_data, default_targets, lora_exclude_modules, task_head

__all__ = ["Run", "build_lora_model", "build_run", "default_lr"]


@dataclass
class Run:
    cfg: TrainConfig
    model: nn.Module  # the PEFT model
    tokenizer: object
    data: TaskData
    private: PrivateLoRA
    lr: float
    targets: list[str]
    exclude: str | None  # PEFT exclude_modules (a multimodal model's vision tower)
    device: torch.device
    num_labels: int | None
    world: World | None = None
    base: FrozenBase | None = None  # how the frozen base is stored (prismdp.base)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"method: unknown method {method!r}; choose one of {', '.join(METHODS)}")


def default_lr(cfg: TrainConfig, method: str | None = None) -> float:
    """The default learning rate of ``method`` (default ``cfg.method``) for the task family of ``cfg``
    (:attr:`prismdp.engine.MethodSpec.lr`)."""
    method = method or cfg.method
    check_method(method)
    rates = METHODS[method].lr
    if cfg.task_family not in rates:
        raise ConfigError(f"lr: no default learning rate for method {method!r} on {cfg.task_family} tasks; pass --lr")
    return rates[cfg.task_family]


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every LoRA target name must name a module (PEFT matches ``name`` or a name ending in ``.name``, and ignores a
    name that matches nothing as long as another one matches: a misspelling would silently train fewer layers)."""
    names = [n for n, _ in model.named_modules()]
    unknown = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise ConfigError(f"target_modules: {unknown} name no module of this model; pass --target-modules with "
                          f"names of its linear layers: {', '.join(linear)}")


def position_limit(model: nn.Module) -> int | None:
    """The longest input a model with learned absolute position embeddings (BERT's ``position_embeddings``, GPT-2's
    ``wpe``) accepts; None for models without them (RoPE)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in ("position_embeddings", "wpe"):
            pad = module.padding_idx  # RoBERTa numbers positions from padding_idx + 1
            return module.num_embeddings - (pad + 1 if pad is not None else 0)
    return None


def check_lengths(model: nn.Module, data: TaskData) -> None:
    """Refuse examples longer than the model's position embeddings (a shape error in the first forward otherwise)."""
    limit = position_limit(model)
    if limit is None:
        return
    sets = {"training": data.train, **data.eval_sets}
    longest = {name: max((len(ex["input_ids"]) for ex in exs), default=0) for name, exs in sets.items()}
    name, n = max(longest.items(), key=lambda kv: kv[1])
    if n > limit:
        raise ConfigError(f"max_length: the {name} set has examples of {n} tokens, but this model has position "
                          f"embeddings for {limit}; pass --max-length {limit} (or less)")


def build_lora_model(cfg: TrainConfig, model: nn.Module, task_type: str | None = None
                     ) -> tuple[nn.Module, list[str], str | None]:
    """``get_peft_model`` with the run's LoRA settings (rank, alpha, dropout; targets default per model family; a
    multimodal model's non-text towers excluded): the one place a LoRA configuration is made (``prismdp train``, the
    diagnostics and the benchmarks).  ``task_type`` ``"seq_cls"`` / ``"causal_lm"`` picks PEFT's task wrapper
    (``None``: a plain ``PeftModel``, e.g. for a bare module).  Returns the PEFT model, the targets and the exclusion
    pattern."""
    targets = cfg.target_modules or default_targets(model)
    check_targets(model, targets)
    exclude = lora_exclude_modules(model)  # vision tower etc. of a multimodal checkpoint: text-only training
    peft_task = {"seq_cls": "SEQ_CLS", "causal_lm": "CAUSAL_LM", None: None}[task_type]
    lora_cfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                          exclude_modules=exclude, task_type=peft_task)
    return get_peft_model(model, lora_cfg), targets, exclude


def build_run(cfg: TrainConfig, *, world: World | None = None, log=print, extend_data=None,
              **make_private_kwargs) -> Run:
    """Load the model and data of ``cfg``, put LoRA on it and make it private (``make_private_kwargs`` go to
    :func:`~prismdp.engine.make_private`, e.g. ``start=``).  ``extend_data(data, tokenizer, num_labels)`` may add
    training examples before the run is made private (the audit's input canaries): they are then part of the dataset
    the sample rate and the accountant see."""
    check_method(cfg.method)
    _check_base(cfg, world)
    device = cfg.torch_device(world)
    lr = cfg.lr if cfg.lr is not None else default_lr(cfg)
    torch.manual_seed(cfg.seed)  # the same initial model on every rank (seeds every CUDA device too)
    task_type, num_labels = task_head(cfg)
    # Everything that can be checked without the weights is checked before loading them (minutes on an 8B model):
    # the data (read with the tokenizer alone), delta against its size, and the LoRA targets on a meta-device model.
    tokenizer = load_tokenizer(cfg.model, task_type)
    data = build_task_data(cfg, tokenizer)
    if extend_data is not None:
        extend_data(data, tokenizer, num_labels)
    if cfg.dp:
        check_delta(cfg.delta, data.n_units, allow_large=cfg.allow_large_delta, unit=cfg.privacy_unit)

    def load(dtype=None, **kw):
        return load_model(cfg.model, task_type, num_labels, dtype=dtype or cfg.torch_dtype(), pooling=cfg.pooling,
                          tokenizer=tokenizer, **kw)[0]

    model = _load_checked(cfg, load, task_type, num_labels, device)
    check_lengths(model, data)
    for message in data.warnings:
        log(f"[prismdp] warning: {message}")
    for key, count in data.notes.items():
        if ("truncated" in key or ("masked" in key and not data.warnings)) and count:
            log(f"[prismdp] {key}: {count} example(s) (max_length={cfg.max_length})")
        if key.endswith("blank") and count:
            log(f"[prismdp] warning: {key}: {count} example(s) with an empty sentence (kept: they train on the label "
                "alone; remove them from the data if they are a mistake)")
    for name, reason in data.gen_eval_missing.items():
        log(f"[prismdp] eval set {name} is missing (reported in summary.json): {reason}")
    model, targets, exclude = build_lora_model(cfg, model, task_type)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    # before make_private: its rank-r start then reads W0 one layer at a time (gathered, de-quantized)
    base = prepare_base(model, cfg.quantize, cfg.fsdp, cfg.torch_dtype(), world, device=device,
                        whole=_whole_on_rank0(cfg, load, task_type, model, world, log))
    if cfg.fsdp and cfg.quantize:
        left = base.held["float"]
        log(f"[prismdp] 4-bit base sharded (torchao NF4): {len(base.held['nf4'])} linear layers"
            + (f"; {len(left)} left in --dtype (not whole NF4 blocks of 64, or its rows or scale groups do not "
               f"split into {world.size} shards): {left[:3]}" if left else ""))
    private = make_private(
        model, method=cfg.method, lr=lr, dataset_size=data.n_units, batch_size=cfg.batch_size, steps=cfg.steps,
        target_epsilon=cfg.epsilon if cfg.dp and cfg.sigma is None else None,
        noise_multiplier=cfg.sigma if cfg.dp else None, delta=cfg.delta, max_grad_norm=cfg.max_grad_norm,
        accountant=cfg.accountant, seed=None if cfg.secure_noise else cfg.seed, init=cfg.init,
        rank_r_start=True if cfg.start == "rank-r" else None, dense_lr=cfg.head_lr, world=world,
        secure_noise=cfg.secure_noise, noise_threads=cfg.noise_threads, allow_large_delta=cfg.allow_large_delta,
        products=cfg.products, **make_private_kwargs, **cfg.method_kwargs,
    )
    return Run(cfg, model, tokenizer, data, private, lr, targets, exclude, device, num_labels, world, base)


def _load_checked(cfg: TrainConfig, load, task_type: str, num_labels: int | None, device: torch.device) -> nn.Module:
    """The model LoRA goes on, its LoRA targets checked on a meta-device skeleton before any weight is read.
    ``--fsdp``: the skeleton itself, built alike on every rank (rank 0 alone reads the weights:
    :func:`_whole_on_rank0`); otherwise the loaded model (a quantized base is loaded on its device, where bitsandbytes
    quantizes it)."""
    skeleton = load(meta=True) if cfg.fsdp else model_skeleton(cfg.model, task_type, num_labels, pooling=cfg.pooling)
    if skeleton is not None:
        check_targets(skeleton, cfg.target_modules or default_targets(skeleton))
    return skeleton if cfg.fsdp else load(quantize=cfg.quantize, device=device if cfg.quantize else None)


def _whole_on_rank0(cfg: TrainConfig, load, task_type: str, skeleton: nn.Module, world: World | None, log):
    """``--fsdp``, rank 0: the whole model read into host memory with LoRA on it as on ``skeleton``, the values the
    shards are made of (:func:`prismdp.base.prepare_base`); None elsewhere.  A causal LM is read in its stored dtype
    (memory-mapped: page cache, not a converted copy) and converted tensor by tensor as the units are sent; a new
    classification head would be initialised in the stored dtype, so other tasks read in --dtype, as one process
    does."""
    if not cfg.fsdp or world.rank != 0:
        return None
    read = (stored_dtype(cfg.model, task_type) if task_type == "causal_lm" else None) or cfg.torch_dtype()
    note = whole_read_note(cfg.model, task_type, read, sum(p.numel() * p.element_size() for p in skeleton.parameters()))
    if note:
        log(f"[prismdp] warning: --fsdp: {note}")
    return build_lora_model(cfg, load(dtype=read), task_type)[0]


def _check_base(cfg: TrainConfig, world: World | None) -> None:
    """The rules of --quantize, --fsdp, --dtype and the device (:func:`prismdp.base.check_base`), before anything is
    loaded: a one-process --fsdp run is a :class:`~prismdp.base.ShardingError`, the rest a :class:`ConfigError`."""
    try:
        check_base(cfg.quantize, cfg.fsdp, world=world, dtype=cfg.torch_dtype(),
                   device=None if cfg.fsdp else cfg.torch_device(world))
    except ShardingError:
        raise
    except BaseError as e:
        raise ConfigError(str(e)) from None
