"""prismdp inside the Hugging Face ``Trainer``: :class:`PrivacyArguments` and :class:`PrivateTrainer`.

::

    from prismdp.integrations.hf import PrivacyArguments, PrivateTrainer

    trainer = PrivateTrainer(model=peft_model, args=TrainingArguments(...), train_dataset=ds,
                             data_collator=collator,
                             privacy_args=PrivacyArguments(target_epsilon=3, expected_batch_size=64))
    trainer.train()
    trainer.save_model()                 # a stock PEFT adapter for the original base model, and privacy.json
    trainer.privacy_report()             # the same dict as privacy.json

The Trainer runs prismdp's engine (:func:`prismdp.engine.make_private`, the engine of ``prismdp train``) instead
of its own batching, loss and optimizer:

* each Trainer step is one logical step: a Poisson sample of expected size ``expected_batch_size`` over the training
  set (examples, or users with ``privacy_unit="user"``), split into micro-batches of ``per_device_train_batch_size``
  (a variable number, zero for an empty sample); the data collator pads each micro-batch;
* per-example losses come from the model's logits (causal LM: each example's mean over its own target tokens,
  ``labels`` -100 masked; sequence classification: cross-entropy), never the batch-mean loss; the Trainer's gradient
  clipping is off (the mechanism clips per example);
* sigma is calibrated for exactly the steps the Trainer takes (``max_steps``, or ``num_train_epochs`` converted with
  the expected batch); the learning-rate scheduler steps once per logical step;
* ``epsilon``, ``clip_fraction`` and ``noise_multiplier`` go through ``Trainer.log`` (every ``report_to``);
* checkpoints carry the whole privacy state (:meth:`prismdp.engine.PrivateLoRA.state_dict`, ``prismdp_state.pt``),
  and ``train(resume_from_checkpoint=...)`` continues exactly;
* under ``torchrun`` it is prismdp's multi-process engine (:mod:`prismdp.distributed`): the model is never run through
  DDP, so no gradient is all-reduced outside the mechanism; with the Trainer's FSDP settings (``fsdp=...``) the frozen
  base is sharded by prismdp (:func:`prismdp.base.prepare_base`, FSDP2) and the LoRA factors stay whole on every process.

What breaks the accounting is refused, with the reason: an ``IterableDataset``, ``group_by_length``,
``auto_find_batch_size``, ``gradient_accumulation_steps`` (the logical batch is ``expected_batch_size``),
``dataloader_drop_last``, a collator that drops or duplicates examples.

TRL: ``private_trainer_class(SFTTrainer)`` gives the same behaviour on top of another Trainer subclass.  Examples
its preparation drops (a completion cut off entirely by ``max_length``) are counted in a warning; the guarantee
counts the rows kept.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..quiet import install as install_quiet

install_quiet()  # before transformers' Trainer imports its optional backends, which log (prismdp.quiet)

from transformers import Trainer  # noqa: E402

from ..atomic import write_json  # noqa: E402
from ..engine import METHODS, make_private, to_device
from ..export import export_adapter
from ..losses import causal_lm_losses, classification_losses
from ..distributed import current_world
from ..privacy.accounting import ACCOUNTANTS, check_delta
from ..base import is_sharded, prepare_base

__all__ = ["PrivacyArguments", "PrivateTrainer", "PrivacyMixin", "private_trainer_class", "PRIVACY_STATE_NAME"]

PRIVACY_STATE_NAME = "prismdp_state.pt"
_MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")  # what a collated batch feeds


@dataclass
class PrivacyArguments:
    """Differential privacy of a :class:`PrivateTrainer` run (``HfArgumentParser`` reads it from the command line)."""

    method: str = field(default="prism", metadata={"help": "a method registered in prismdp.engine.METHODS: prism, "
                                                           "dp-adamw, ffa, lora-plus, lamb, lora-rite, ..."})
    target_epsilon: float | None = field(default=None, metadata={"help": "epsilon to reach (sigma is calibrated)"})
    noise_multiplier: float | None = field(default=None, metadata={"help": "or a fixed noise multiplier sigma"})
    target_delta: float = field(default=1e-5, metadata={"help": "delta (below 1 / dataset size)"})
    allow_large_delta: bool = field(default=False, metadata={"help": "accept a delta at or above 1 / dataset size "
                                                                     "(a weak guarantee)"})
    per_sample_max_grad_norm: float = field(default=1.0, metadata={"help": "clipping bound C"})
    accountant: str = field(default="prv", metadata={"help": "prv, rdp (Opacus) or pld (dp-accounting)"})
    expected_batch_size: int = field(default=64, metadata={"help": "expected logical batch (Poisson, examples or "
                                                                    "users)"})
    privacy_unit: str = field(default="example", metadata={"help": "example or user"})
    user_id_column: str | None = field(default=None, metadata={"help": "the dataset column naming each example's "
                                                                        "user (privacy_unit user)"})
    secure_noise: bool = field(default=False, metadata={"help": "noise and Poisson sampling from an OS-keyed "
                                                                       "ChaCha20 generator (prismdp.privacy.secure); "
                                                                       "the Trainer's seed then seeds only the model"})
    noise_threads: int | None = field(default=None, metadata={"help": "secure_noise: CPU threads drawing the noise "
                                                                       "(default: torch's; torchrun sets 1 per "
                                                                       "process)"})
    products: str = field(default="float32", metadata={"help": "precision of the per-example gradient products: "
                                                                "float32, or tf32 / bf16 inputs with float32 "
                                                                "accumulation"})
    disable_dp: bool = field(default=False, metadata={"help": "train the same method without clipping and noise"})
    method_kwargs: str | None = field(default=None, metadata={"help": "the method's options as a JSON/YAML mapping, "
                                                                      "e.g. '{preset: reference}'"})

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"PrivacyArguments.method: unknown method {self.method!r}; choose one of {sorted(METHODS)}")
        if not self.disable_dp and (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("PrivacyArguments: give target_epsilon (sigma is calibrated for the run) or "
                             "noise_multiplier, exactly one of them (or disable_dp=True)")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"PrivacyArguments.accountant must be one of {sorted(ACCOUNTANTS)}, got "
                             f"{self.accountant!r}")
        if self.privacy_unit not in ("example", "user"):
            raise ValueError(f"PrivacyArguments.privacy_unit must be 'example' or 'user', got {self.privacy_unit!r}")
        if (self.privacy_unit == "user") != (self.user_id_column is not None):
            raise ValueError("PrivacyArguments: privacy_unit='user' needs user_id_column (the column naming each "
                             "example's user), and user_id_column applies to privacy_unit='user' only")
        if not self.expected_batch_size >= 1:
            raise ValueError(f"PrivacyArguments.expected_batch_size must be >= 1, got {self.expected_batch_size}")

    def options(self) -> dict:
        if not self.method_kwargs:
            return {}
        import yaml

        value = yaml.safe_load(self.method_kwargs)
        if not isinstance(value, dict):
            raise ValueError(f"PrivacyArguments.method_kwargs must be a mapping, got {self.method_kwargs!r}")
        return value


def _refuse(why: str) -> None:
    raise ValueError(f"PrivateTrainer: {why}")


class _LogicalBatches:
    """The Trainer's training 'dataloader': one item per logical step, the Poisson sample of this process's share
    (privacy units), as ``{"prismdp_units": [...]}``; its length is the run's number of steps."""

    def __init__(self, private, steps: int):
        self.private, self.steps = private, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for batch in self.private.batches():
            yield {"prismdp_units": batch.tolist()}


class _StepOptimizer:
    """What the Trainer calls ``optimizer``: ``step()`` is the private step of the logical batch (clip, noise, update);
    ``param_groups`` are the real optimizer's (the scheduler sets their rates); its own state is in the privacy state."""

    def __init__(self, trainer: "PrivacyMixin"):
        self.trainer = trainer
        self.inner = getattr(trainer.private.optimizer, "optimizer", trainer.private.optimizer)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self, closure=None):
        private = self.trainer.private
        self.trainer._last_report = private.queue_step()  # read only when the Trainer logs
        step = self.trainer.state.global_step + 1  # the Trainer counts the step after the optimizer's
        private.after_step(step)  # every rank must hold the same trained tensors

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.trainer.private.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        pass


def per_example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(b,) losses from a model's logits: a causal LM's (logits (b, T, V), labels (b, T), -100 masked: each example's
    mean over its own target tokens) or a sequence classifier's (cross-entropy; squared error for one output)."""
    if logits.dim() == 3:
        return causal_lm_losses(logits, labels)
    return classification_losses(logits, labels)


def _warn_if_preparation_dropped(given: int, kept: int) -> None:
    """Say so when the Trainer subclass's own preparation (TRL's ``SFTTrainer`` drops the examples whose completion
    ends up fully masked after truncation to ``max_length``) leaves fewer rows than the user passed: those examples are
    never trained on, and the guarantee counts only the rows kept."""
    if kept < given:
        warnings.warn(f"the Trainer's data preparation kept {kept} of the {given} training examples given "
                      f"({given - kept} dropped, {100 * (given - kept) / given:.1f} %; TRL's SFTTrainer drops examples "
                      "whose completion is cut off entirely by max_length). They are not trained on; the privacy "
                      f"accounting uses the {kept} kept. To keep them, raise max_length or shorten the prompts.",
                      UserWarning, stacklevel=3)


class PrivacyMixin:
    """The privacy behaviour of :class:`PrivateTrainer`, to put in front of any ``Trainer`` subclass
    (:func:`private_trainer_class`)."""

    def __init__(self, model=None, args=None, *rest, privacy_args: PrivacyArguments | None = None, **kwargs):
        install_quiet()
        if privacy_args is None:
            raise ValueError("PrivateTrainer needs privacy_args=PrivacyArguments(...)")
        if rest:
            raise TypeError("PrivateTrainer takes its arguments after model and args by keyword "
                            "(train_dataset=..., data_collator=..., ...)")
        self.privacy_args = p = privacy_args
        targs, dataset = args, kwargs.get("train_dataset")
        if targs is None or dataset is None:
            raise ValueError("PrivateTrainer needs args=TrainingArguments(...) and train_dataset=...")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            _refuse("an IterableDataset (or any dataset without a length) cannot be Poisson-sampled: the accountant "
                    "needs the dataset size and every example's independent inclusion. Materialise it (e.g. "
                    "datasets.Dataset.from_generator) first.")
        strategy = getattr(targs, "train_sampling_strategy", "random")
        if getattr(targs, "group_by_length", False) or strategy not in ("random", "sequential"):
            _refuse(f"group_by_length (train_sampling_strategy={strategy!r}) changes which examples form a batch; "
                    "batches must be Poisson samples. Use the default sampling strategy (prismdp draws the batches "
                    "itself; ordering a logical batch by length before micro-batching changes nothing in the "
                    "mechanism).")
        if targs.auto_find_batch_size:
            _refuse("auto_find_batch_size retries steps with other batch sizes after failures; a retried step would "
                    "spend privacy twice. Set auto_find_batch_size=False and choose per_device_train_batch_size.")
        if targs.gradient_accumulation_steps != 1:
            _refuse(f"gradient_accumulation_steps={targs.gradient_accumulation_steps}: the logical batch is "
                    "PrivacyArguments.expected_batch_size (a Poisson sample, split into micro-batches of "
                    "per_device_train_batch_size); leave gradient_accumulation_steps at 1.")
        if getattr(targs, "packing", False) or getattr(targs, "padding_free", False):
            _refuse("packing / padding_free join several examples into one sequence, so a per-example gradient would "
                    "mix examples (and a clipped unit would be several people's data). Set packing=False and "
                    "padding_free=False.")
        if targs.dataloader_drop_last:
            _refuse("dataloader_drop_last drops examples; every sampled example must be used. Set "
                    "dataloader_drop_last=False.")
        steps = targs.max_steps if targs.max_steps > 0 else None
        shard = bool(targs.fsdp)  # the Trainer's FSDP settings: prismdp shards the frozen base itself
        # one Trainer step = one logical step, the Trainer's clipping off, our sampler positioned by the privacy state;
        # no FSDP wrapping by the Trainer (it would shard the LoRA factors and reduce their gradients); its NaN/inf
        # loss filter off: it reads the loss to the host every step (on a GPU a wait for the device per step), so a
        # non-finite loss is logged as it is (the mechanism gives a non-finite example no weight and counts it)
        targs = dataclasses.replace(targs, max_steps=steps or 1, max_grad_norm=0.0, ignore_data_skip=True,
                                    logging_nan_inf_filter=False,
                                    **({"fsdp": "", "fsdp_config": None} if shard else {}))
        super().__init__(model=model, args=targs, **kwargs)
        if shard:  # the one sharding path of prismdp train --fsdp, on a model every rank built whole
            prepare_base(self.model, fsdp=True, world=current_world())
            # the Trainer still wraps the model in DDP (never run: training_step uses self.model); DDP must not
            # broadcast the sharded weights (DTensors) when it is built.  torch's DDP has no public way to leave
            # parameters out (this sets the attribute its constructor reads); see docs/architecture.md
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.model, [n for n, p in self.model.named_parameters() if is_sharded(p)])
        _warn_if_preparation_dropped(len(dataset), len(self.train_dataset))
        # the rows the Trainer really trains on (TRL's preparation may drop some): what the guarantee counts
        self._units = self._privacy_units(self.train_dataset, p)
        n_units = len(self._units) if self._units is not None else len(self.train_dataset)
        if steps is None:  # epochs of Poisson sampling: an epoch is n_units / expected_batch_size steps
            steps = math.ceil(args.num_train_epochs * n_units / p.expected_batch_size)
            self.args.max_steps = steps
        if p.expected_batch_size > n_units:
            _refuse(f"expected_batch_size={p.expected_batch_size} exceeds the {n_units} "
                    f"{'users' if self._units is not None else 'examples'} of the training set")
        if not p.disable_dp:  # before make_private, whose message names its own keyword and the CLI flag
            check_delta(p.target_delta, n_units, allow_large=p.allow_large_delta,
                        unit="user" if self._units is not None else "example",
                        accept="PrivacyArguments(allow_large_delta=True)")
        self._train_rows = self.train_dataset
        if self.args.remove_unused_columns and hasattr(self.train_dataset, "column_names"):
            self._train_rows = self._remove_unused_columns(self.train_dataset, description="training")
        self.private = make_private(
            self.model, method=p.method, lr=self.args.learning_rate, dataset_size=n_units,
            batch_size=p.expected_batch_size, steps=steps,
            target_epsilon=None if p.disable_dp else p.target_epsilon,
            noise_multiplier=None if p.disable_dp else p.noise_multiplier, delta=p.target_delta,
            max_grad_norm=p.per_sample_max_grad_norm, accountant=p.accountant,
            seed=None if p.secure_noise else self.args.seed, secure_noise=p.secure_noise,
            noise_threads=p.noise_threads, allow_large_delta=p.allow_large_delta, products=p.products,
            **p.options())
        self.optimizer = _StepOptimizer(self)
        self._last_report = None  # the last step's StepReport, unread until a log needs it
        self._steps = steps
        self._dataset_size = n_units

    @staticmethod
    def _privacy_units(dataset, p: PrivacyArguments):
        if p.privacy_unit != "user":
            return None
        names = getattr(dataset, "column_names", None)
        if names is not None and p.user_id_column not in names:
            _refuse(f"user_id_column {p.user_id_column!r} is not a column of the training set ({names})")
        users = dataset[p.user_id_column] if names is not None else [row[p.user_id_column] for row in dataset]
        by_user: dict = {}
        for i, u in enumerate(users):
            by_user.setdefault(u, []).append(i)
        return list(by_user.values())

    # ---------------------------------------------------------------- what the Trainer sees

    def train(self, *args, **kwargs):
        if self.args.max_steps != self._steps:
            _refuse(f"args.max_steps is {self.args.max_steps}, but sigma was calibrated (and the Poisson batches "
                    f"drawn) for {self._steps} steps when the trainer was built; build a new PrivateTrainer with "
                    "the new max_steps")
        return super().train(*args, **kwargs)

    def get_train_dataloader(self):
        return _LogicalBatches(self.private, self._steps)

    def create_optimizer(self, model=None):
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return super().create_scheduler(num_training_steps, optimizer=self.optimizer.inner)

    def _get_num_items_in_batch(self, batch_samples, device):
        return None

    def _rows(self, indices: list[int]) -> list[dict]:
        drop = self.privacy_args.user_id_column
        return [{k: v for k, v in dict(self._train_rows[i]).items() if k != drop} for i in indices]

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """One logical step's forward and backward passes (the optimizer step follows, as ``optimizer.step()``)."""
        from ..train.step import backward_micro_batches, micro_batch_plan

        model = self.model  # never the DDP wrapper: the mechanism reduces what it releases, nothing else is reduced
        model.train()

        def losses_of(ids: list[int]) -> torch.Tensor:
            batch = self.data_collator(self._rows(ids))
            labels = batch.pop("labels", None)
            if labels is None:
                labels = batch.pop("label", None)
            if labels is None or labels.shape[0] != len(ids):
                _refuse(f"the data collator returned {None if labels is None else labels.shape[0]} label rows for "
                        f"{len(ids)} examples; it must keep every example (no dropping, no duplicating) and "
                        "return 'labels'")
            device = self.args.device  # pinned, asynchronous copies: no wait for the device per micro-batch
            batch = self._prepare_inputs({k: to_device(v, device) if torch.is_tensor(v) else v
                                          for k, v in batch.items() if k in _MODEL_INPUTS})
            logits = model(**batch).logits
            return per_example_losses(logits, to_device(labels, logits.device))

        # sampled order (whole users per micro-batch with privacy_unit user)
        plan = micro_batch_plan(inputs["prismdp_units"], None, self.args.per_device_train_batch_size,
                                group_by_length=False, units=self._units)
        totals = backward_micro_batches(self.private, plan, losses_of)  # stays on the device: the Trainer reads
        return (totals[0] / totals[1].clamp_min(1)).float().to(self.args.device)  # its loss when it logs

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs:  # training logs: the privacy spent so far and the last step's clipping
            logs.pop("grad_norm", None)  # the Trainer's own gradient norm means nothing here (the mechanism clips)
            if self.private.private:
                logs["epsilon"] = self.private.epsilon
                logs["noise_multiplier"] = self.private.dp.noise_multiplier
            stats = self._last_report.read() if self._last_report is not None else {}
            for key in ("clip_fraction", "batch_size"):
                if key in stats:
                    logs[key] = stats[key]
        super().log(logs, start_time)

    # ---------------------------------------------------------------- checkpoints and the adapter

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        state = self.private.state_dict()  # every rank calls it (it gathers the per-rank parts)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(state, os.path.join(output_dir, PRIVACY_STATE_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, PRIVACY_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{checkpoint} holds no {PRIVACY_STATE_NAME}: it was not written by a "
                                    "PrivateTrainer, so the privacy state (spent budget, sampler, noise stream) "
                                    "cannot be restored")
        # onto the CPU, as `prismdp train` reads its checkpoint (load_state_dict moves each part to its device): read
        # as saved, every rank of a multi-GPU run would put rank 0's CUDA tensors on GPU 0
        self.private.load_state_dict(torch.load(path, weights_only=False, map_location="cpu"))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        pass  # the trained tensors come back with the privacy state (the saved adapter is for the original base)

    def _load_rng_state(self, checkpoint) -> None:
        pass  # restored with the privacy state (per rank)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A stock PEFT adapter for the original base model (PRISM: rank 2r, ``Z - Z0``) and ``privacy.json``."""
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        export_adapter(self.model, self.private.pairs, self.private.start, output_dir)
        write_json(os.path.join(output_dir, "privacy.json"), self.privacy_report())
        if self.processing_class is not None and not _internal_call:
            self.processing_class.save_pretrained(output_dir)

    def privacy_report(self) -> dict:
        """The same dict as ``privacy.json`` of ``prismdp train``."""
        rep = self.private.privacy_report()
        if self.private.private:
            rep.update(dataset_size=self._dataset_size, privacy_unit=self.privacy_args.privacy_unit)
        return rep


class PrivateTrainer(PrivacyMixin, Trainer):
    """``transformers.Trainer`` with prismdp's private engine (see the module docstring)."""


def private_trainer_class(base: type) -> type:
    """``PrivacyMixin`` in front of another ``Trainer`` subclass (e.g. TRL's ``SFTTrainer``)."""
    if not issubclass(base, Trainer):
        raise TypeError(f"{base.__name__} is not a transformers.Trainer subclass")
    return type(f"Private{base.__name__}", (PrivacyMixin, base), {})
