"""What a diagnostic depends on: a :class:`~prismdp.train.config.TrainConfig` (the run: model, task, LoRA, privacy)
and the diagnostics' own knobs.  ``prismdp diagnose``'s flags are generated from both (import-light: no torch).

The runs read :data:`RUN_KEYS` of the TrainConfig, with :data:`RUN_DEFAULTS` instead of the trainer's defaults (short
CPU runs: a small batch in one micro-batch, short sequences, rank 8, no dropout, a 2,000-example built-in task).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..flags import option
from ..train.config import ConfigError, TrainConfig

__all__ = ["Settings", "RUN_KEYS", "RUN_DEFAULTS", "OWN_RUN_KEYS", "DIAGNOSTIC_KEYS"]

#: The TrainConfig keys the diagnostics' runs read (each a ``prismdp diagnose`` flag, spelled as for prismdp train).
RUN_KEYS = ("model", "task", "data", "epsilon", "delta", "accountant", "rank", "alpha", "dropout", "batch_size",
            "micro_batch_size", "max_length", "lr", "max_grad_norm", "target_modules", "train_examples",
            "synthetic_train", "init")
#: The diagnostics' defaults where they differ from the trainer's.
RUN_DEFAULTS = {"batch_size": 32.0, "micro_batch_size": 32, "max_length": 48, "rank": 8, "dropout": 0.0,
                "synthetic_train": 2000, "synthetic_test": 2}


def _default_run() -> TrainConfig:
    return TrainConfig(**RUN_DEFAULTS)


@dataclass
class Settings:
    """Everything a diagnostic run depends on: ``run`` (its TrainConfig; ``run.seed`` is the first of ``seeds``) and
    the diagnostics' own settings."""

    run: TrainConfig = field(default_factory=_default_run)
    steps: int | None = option(None, "steps per run (defaults: gauge-training 30, noise-vs-S 30, amplification 60, "
                                     "sigma-sweep 120; gauge-sweep: length of the run whose tau is used, 60)")
    seeds: list[int] = option(None, "comma-separated seeds (default 42)", factory=lambda: [42])
    baseline_start: str = option("peft", "DP-AdamW's start: PEFT's init (default) or PRISM's rank-r start",
                                 choices=("peft", "rank-r"))
    prism_kwargs: dict = option(None, "PRISM's options as a YAML mapping, e.g. '{preset: reference}' or "
                                      "'{floor_mode: geometry}'", factory=dict)
    gauges: list[float] = option(None, "gauge scales c (default 0.25,0.5,1,2,4)",
                                 factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])
    epsilons: list[float] = option(None, "sigma-sweep epsilons (default 1.5,3,6,12)",
                                   factory=lambda: [1.5, 3.0, 6.0, 12.0])
    burn_in: int = option(10, "sigma-sweep: steps discarded (default 10)")
    draws: int = option(64, "gauge-sweep: Monte-Carlo draws per c (default 64)")
    sweep_points: int = option(61, "gauge-sweep: values of c (default 61)")
    sweep_decades: float = option(3.0, "gauge-sweep: log10 c range (3)")  # log10 c in [-decades, decades]
    sweep_source: str = option("start", "gauge-sweep: a module after the rank-r start (default) or a random rank-r Z",
                               choices=("start", "random"))
    module: str | None = option(None, "gauge-sweep: module name substring (default: the largest S)")
    window: int = option(25, "amplification: moving-average window (default 25)")
    output: str = option("runs/diagnostics", "output folder (default runs/diagnostics)")
    progress: bool = option(True, "no progress bars or log lines", flag="--quiet")

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
        if self.run.seed != self.seeds[0]:  # seeded subsets of the training data follow the first seed
            self.run = dataclasses.replace(self.run, seed=self.seeds[0])

    @classmethod
    def from_dict(cls, values: dict) -> Settings:
        """Settings from flat keys: :data:`RUN_KEYS` go to the run's TrainConfig (over :data:`RUN_DEFAULTS`), the
        others are the diagnostics' own."""
        own = {f.name for f in dataclasses.fields(cls)} - {"run"}
        unknown = sorted(set(values) - own - set(RUN_KEYS))
        if unknown:
            raise ConfigError(f"diagnostics: unknown key(s) {unknown}; valid keys: {sorted(own | set(RUN_KEYS))}")
        run = TrainConfig.from_dict({**RUN_DEFAULTS, **{k: v for k, v in values.items() if k in RUN_KEYS}},
                                    source="diagnostics")
        return cls(run=run, **{k: v for k, v in values.items() if k in own})


#: The diagnostics' own keys that shape a run (shown with RUN_KEYS), and those of the diagnostics proper.
OWN_RUN_KEYS = ("steps", "seeds", "baseline_start", "prism_kwargs")
DIAGNOSTIC_KEYS = ("gauges", "epsilons", "burn_in", "draws", "sweep_points", "sweep_decades", "sweep_source", "module",
                   "window")
