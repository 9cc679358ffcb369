"""Short instrumented DP training runs for the diagnostics, built like ``prismdp train`` builds them.

:class:`Settings` holds the knobs (the trainer's, with small defaults); :class:`Session` loads the model, the
tokenizer and the task data once (through :mod:`prismdp.train.tasks` / :mod:`prismdp.models`, so every model
and task the trainer supports works) and makes runs; :meth:`Session.run` gives one private run of ``prism`` or
``dp-adamw``, optionally from a gauge-rescaled start, whose :meth:`Run.records` yields one
:class:`~prismdp.diagnostics.probe.StepMeasure` per optimizer step.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..engine import DEFAULT_LR, make_private
from ..lora import find_lora_pairs, get_factors, move_to_rank_r_start, set_factors
from ..models import load_model
from ..privacy import calibrate_sigma
from ..train.build import build_lora_model
from ..train.config import TrainConfig
from ..train.step import backward_batch
from ..train.tasks import build_task_data, default_targets, task_head
from . import measures
from .probe import StepMeasure, make_probe

__all__ = ["Settings", "Session", "Run", "COMPARED", "METHOD_LABELS"]

COMPARED = ("dp-adamw", "prism")  # the factor-space baseline and PRISM
METHOD_LABELS = {"dp-adamw": "DP-AdamW (factor space)", "prism": "PRISM"}


@dataclass
class Settings:
    """Everything a diagnostic run depends on (the trainer's flags, with small CPU-friendly defaults)."""

    model: str | None = None  # None = packaged MiniLM (built-in synthetic task) / SmolLM2 (instruct)
    task: str = "synthetic"
    data: str | None = None
    steps: int | None = None  # None = the diagnostic's own default
    seeds: list[int] = field(default_factory=lambda: [42])
    epsilon: float = 3.0
    delta: float = 1e-5
    accountant: str = "prv"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    batch_size: float = 32.0
    micro_batch_size: int = 32
    max_length: int = 48
    lr: float | None = None  # None = the method's default (engine.DEFAULT_LR)
    max_grad_norm: float = 1.0
    target_modules: list[str] | None = None
    train_examples: int | None = None
    synthetic_train: int = 2000
    init: str = "spectral"  # PRISM's rank-r start
    baseline_start: str = "peft"  # dp-adamw: PEFT's own init (lora_B = 0) or the same rank-r start as PRISM
    prism_kwargs: dict = field(default_factory=dict)  # PRISM's options (preset, floor_mode, ...)
    gauges: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])
    epsilons: list[float] = field(default_factory=lambda: [1.5, 3.0, 6.0, 12.0])
    burn_in: int = 10
    draws: int = 64
    sweep_points: int = 61
    sweep_decades: float = 3.0  # log10 c in [-decades, decades]
    sweep_source: str = "start"  # "start": a module of the model after the rank-r start; "random": random Z
    module: str | None = None  # the swept module (name substring); None = the one with the largest S
    window: int = 25
    output: str = "runs/diagnostics"
    progress: bool = True

    def __post_init__(self):
        if self.baseline_start not in ("peft", "rank-r"):
            raise ValueError(f"baseline_start must be 'peft' or 'rank-r', got {self.baseline_start!r}")
        if self.sweep_source not in ("start", "random"):
            raise ValueError(f"sweep_source must be 'start' or 'random', got {self.sweep_source!r}")
        if not self.seeds:
            raise ValueError("seeds: give at least one seed")
        if any(not c > 0 for c in self.gauges) or not self.gauges:
            raise ValueError(f"gauges must be positive numbers, got {self.gauges}")
        if any(not e > 0 for e in self.epsilons) or not self.epsilons:
            raise ValueError(f"epsilons must be positive numbers, got {self.epsilons}")
        for key, least in (("draws", 2), ("sweep_points", 2), ("window", 1)):
            if getattr(self, key) < least:
                raise ValueError(f"{key} must be >= {least}, got {getattr(self, key)}")
        if self.burn_in < 0:
            raise ValueError(f"burn_in must be >= 0, got {self.burn_in}")

    def train_config(self, steps: int = 1) -> TrainConfig:
        """The equivalent ``prismdp train`` configuration (validates the shared keys)."""
        return TrainConfig(model=self.model, task=self.task, data=self.data, steps=steps, epsilon=self.epsilon,
                           delta=self.delta, accountant=self.accountant, batch_size=self.batch_size,
                           micro_batch_size=self.micro_batch_size, lr=self.lr, rank=self.rank, alpha=self.alpha,
                           dropout=self.dropout, target_modules=self.target_modules,
                           max_grad_norm=self.max_grad_norm, seed=self.seeds[0], max_length=self.max_length,
                           init=self.init, train_examples=self.train_examples,
                           synthetic_train=self.synthetic_train, synthetic_test=2)

    def lr_for(self, method: str) -> float:
        if self.lr is not None:
            return self.lr
        return DEFAULT_LR[self.train_config().task_family][method]


class Session:
    """The loaded model, tokenizer and task data, shared by all runs of one diagnostic."""

    def __init__(self, settings: Settings, log: Callable[[str], None] = print):
        self.settings = s = settings
        self.log = log
        cfg = s.train_config()
        torch.manual_seed(s.seeds[0])
        task_type, num_labels = task_head(cfg)
        self.task_type = task_type
        self.base, self.tokenizer = load_model(cfg.model, task_type, num_labels)
        self.data = build_task_data(cfg, self.tokenizer)
        self.targets = cfg.target_modules or default_targets(self.base)
        self.model_name = getattr(self.base.config, "_name_or_path", None) or str(cfg.model)
        self.describe = (f"{self.base.config.model_type} model {'(packaged default)' if s.model is None else s.model}"
                         f", task {s.task}, {len(self.data.train)} training examples")

    @property
    def dataset_size(self) -> int:
        return len(self.data.train)

    @property
    def sample_rate(self) -> float:
        return self.settings.batch_size / self.dataset_size

    def sigma(self, epsilon: float, steps: int) -> float:
        """The noise multiplier a run of ``steps`` steps at ``epsilon`` gets (calibrated like make_private)."""
        s = self.settings
        return calibrate_sigma(epsilon, s.delta, self.sample_rate, steps, accountant=s.accountant)

    def tau(self, epsilon: float, steps: int) -> float:
        """Per-coordinate std of the released noise, ``sigma C / b``."""
        s = self.settings
        return self.sigma(epsilon, steps) * s.max_grad_norm / s.batch_size

    def peft_model(self, seed: int):
        """A fresh LoRA model (PEFT's init, seeded) on a copy of the loaded base model."""
        torch.manual_seed(seed)
        return build_lora_model(self.settings.train_config(), copy.deepcopy(self.base), self.task_type)[0]

    def rank_r_pairs(self, seed: int, model=None):
        """The LoRA pairs of a fresh model (or of ``model``) after the rank-r start PRISM uses, and the start."""
        model = self.peft_model(seed) if model is None else model
        pairs = find_lora_pairs(model)
        start = move_to_rank_r_start(pairs, init=self.settings.init, generator=torch.Generator().manual_seed(seed + 2))
        return model, pairs, start

    def run(self, method: str, seed: int, steps: int, *, epsilon: float | None = None, gauge: float = 1.0) -> Run:
        return Run(self, method, seed, steps, self.settings.epsilon if epsilon is None else epsilon, gauge)


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
        self.lr = s.lr_for(method)
        private = make_private(self.model, method=method, lr=self.lr, dataset_size=session.dataset_size,
                               batch_size=s.batch_size, steps=steps, target_epsilon=epsilon, delta=s.delta,
                               max_grad_norm=s.max_grad_norm, accountant=s.accountant, seed=seed, init=s.init,
                               start=start, **(s.prism_kwargs if method == "prism" else {}))
        self.private = private
        self.sigma = private.dp.noise_multiplier
        self.tau = private.dp.noise_std / private.dp.expected_batch_size
        self.probe = make_probe(private)
        self.shapes = [p.shape for p in private.pairs]

    def records(self) -> Iterator[StepMeasure]:
        data, pad_id = self.session.data, self.session.tokenizer.pad_token_id
        private, mbs = self.private, self.session.settings.micro_batch_size
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
