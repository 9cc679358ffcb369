"""Short instrumented DP training runs for the diagnostics, built like ``prismdp train`` builds them.

:class:`~prismdp.diagnostics.settings.Settings` holds the knobs (the run's TrainConfig and the diagnostics' own);
:class:`Session` loads the model, the tokenizer and the task data once (through :mod:`prismdp.train.tasks` /
:mod:`prismdp.models`, so every model and task the trainer supports works) and makes runs; :meth:`Session.run` gives
one private run of ``prism`` or ``dp-adamw``, optionally from a gauge-rescaled start, whose :meth:`Run.records`
yields one :class:`~prismdp.diagnostics.probe.StepMeasure` per optimizer step.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Iterator

import torch

from ..engine import make_private
from ..lora import find_lora_pairs, get_factors, move_to_rank_r_start, set_factors
from ..models import load_model
from ..privacy import calibrate_sigma
from ..train.build import build_lora_model, default_lr
from ..train.step import backward_batch
from ..train.tasks import build_task_data, default_targets, task_head
from . import measures
from .probe import StepMeasure, make_probe
from .settings import Settings

__all__ = ["Settings", "Session", "Run", "COMPARED"]

COMPARED = ("dp-adamw", "prism")  # the factor-space baseline and PRISM


class Session:
    """The loaded model, tokenizer and task data, shared by all runs of one diagnostic."""

    def __init__(self, settings: Settings, log: Callable[[str], None] = print):
        self.settings = s = settings
        self.log = log
        cfg = s.run
        torch.manual_seed(s.seeds[0])
        task_type, num_labels = task_head(cfg)
        self.task_type = task_type
        self.base, self.tokenizer = load_model(cfg.model, task_type, num_labels)
        self.data = build_task_data(cfg, self.tokenizer)
        self.targets = cfg.target_modules or default_targets(self.base)
        self.model_name = getattr(self.base.config, "_name_or_path", None) or str(cfg.model)
        where = "(packaged default)" if cfg.model is None else cfg.model
        self.describe = (f"{self.base.config.model_type} model {where}, task {cfg.task}, {len(self.data.train)} "
                         "training examples")

    @property
    def dataset_size(self) -> int:
        return len(self.data.train)

    @property
    def sample_rate(self) -> float:
        return self.settings.run.batch_size / self.dataset_size

    def sigma(self, epsilon: float, steps: int) -> float:
        """The noise multiplier a run of ``steps`` steps at ``epsilon`` gets (calibrated like make_private)."""
        cfg = self.settings.run
        return calibrate_sigma(epsilon, cfg.delta, self.sample_rate, steps, accountant=cfg.accountant)

    def tau(self, epsilon: float, steps: int) -> float:
        """Per-coordinate std of the released noise, ``sigma C / b``."""
        cfg = self.settings.run
        return self.sigma(epsilon, steps) * cfg.max_grad_norm / cfg.batch_size

    def lr_for(self, method: str) -> float:
        """The run's learning rate (both methods), else the method's default for the task family."""
        cfg = self.settings.run
        return cfg.lr if cfg.lr is not None else default_lr(cfg, method)

    def peft_model(self, seed: int):
        """A fresh LoRA model (PEFT's init, seeded) on a copy of the loaded base model."""
        torch.manual_seed(seed)
        return build_lora_model(self.settings.run, copy.deepcopy(self.base), self.task_type)[0]

    def rank_r_pairs(self, seed: int, model=None):
        """The LoRA pairs of a fresh model (or of ``model``) after the rank-r start PRISM uses, and the start."""
        model = self.peft_model(seed) if model is None else model
        pairs = find_lora_pairs(model)
        start = move_to_rank_r_start(pairs, init=self.settings.run.init,
                                     generator=torch.Generator().manual_seed(seed + 2))
        return model, pairs, start

    def run(self, method: str, seed: int, steps: int, *, epsilon: float | None = None, gauge: float = 1.0) -> Run:
        return Run(self, method, seed, steps, self.settings.run.epsilon if epsilon is None else epsilon, gauge)


class Run:
    """One private run; iterate :meth:`records` to train it step by step."""

    def __init__(self, session: Session, method: str, seed: int, steps: int, epsilon: float, gauge: float):
        if method not in COMPARED:
            raise ValueError(f"the diagnostics compare {' and '.join(COMPARED)}, got method {method!r}")
        s = session.settings
        self.session, self.method, self.seed, self.steps, self.gauge = session, method, seed, steps, gauge
        self.model = session.peft_model(seed)
        # the start: PRISM's rank-r point (and DP-AdamW's with baseline_start rank-r) or PEFT's own, rescaled
        # (A, B) -> (cA, B/c) (Z unchanged) before make_private builds the optimizer on it, as if the user had handed
        # these factors over: PRISM re-balances them at construction, DP-AdamW keeps them
        start = None
        if method == "prism" or s.baseline_start == "rank-r":
            _, pairs, start = session.rank_r_pairs(seed, self.model)
        else:
            pairs = find_lora_pairs(self.model)
        with torch.no_grad():
            for pair in pairs:
                A, B = get_factors(pair, torch.float64)
                set_factors(pair, *measures.scalar_gauge(A, B, gauge))
        self.lr = session.lr_for(method)
        cfg = s.run
        private = make_private(self.model, method=method, lr=self.lr, dataset_size=session.dataset_size,
                               batch_size=cfg.batch_size, steps=steps, target_epsilon=epsilon, delta=cfg.delta,
                               max_grad_norm=cfg.max_grad_norm, accountant=cfg.accountant, seed=seed, init=cfg.init,
                               start=start, **(s.prism_kwargs if method == "prism" else {}))
        self.private = private
        self.sigma = private.dp.noise_multiplier
        self.tau = private.dp.noise_std / private.dp.expected_batch_size
        self.probe = make_probe(private)
        self.shapes = [p.shape for p in private.pairs]

    def records(self) -> Iterator[StepMeasure]:
        data, pad_id = self.session.data, self.session.tokenizer.pad_token_id
        private, mbs = self.private, self.session.settings.run.micro_batch_size
        self.model.train()
        torch.manual_seed(self.seed)  # dropout masks: the same for every gauge of a seed
        for batch in private.batches():
            backward_batch(private, self.model, data.train, data.loss, batch, mbs, pad_id)
            yield self.probe.step()

    def run_all(self, progress: bool = False, label: str = "") -> list[StepMeasure]:
        """Train every step; returns the records (logs one line)."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        out = []
        bar = tqdm(total=self.steps, disable=not progress, desc=label or self.method, unit="step", leave=False,
                   dynamic_ncols=True)
        for rec in self.records():
            out.append(rec)
            bar.update(1)
        bar.close()
        self.session.log(f"[diagnose] {label or self.method}: {len(out)} steps in {time.perf_counter() - t0:.1f} s "
                         f"(sigma {self.sigma:.3f})")
        return out
