"""``prismdp tune``: hyperparameter tuning inside the privacy budget (Papernot and Steinke, ICLR 2022).

Random search with a random number of trials: ``K`` is drawn from a declared distribution (:class:`TrialCount`:
truncated negative binomial, geometric, logarithmic or Poisson; or a fixed ``K``, or ``grid``: every combination once,
both accounted by composition), each trial draws its learning rate (and optionally clipping bound and LoRA rank)
uniformly from the declared lists, trains a full private run (``prismdp train``) with the
same per-trial noise multiplier, and is scored on the validation split carved out of the training data
(``holdout_val``) by a noisy count of correct answers (Gaussian, noise multiplier ``score_noise``, sensitivity 1).
The trial with the best noisy score is released in ``OUT/release/``.  The whole procedure's (epsilon, delta) comes
from :mod:`prismdp.privacy.tuning`; the per-trial noise multiplier is calibrated so that it meets ``--epsilon``.

Files::

    OUT/tune.json             the plan, written before any trial runs: distribution, drawn count K, every trial's
                              hyperparameters and seed, the calibrated noise, the guarantee (private: keep it)
    OUT/trial-001/ ...        each trial's run folder, plus score.json (its noisy score; private: keep them)
    OUT/release/              what may be published: adapter/, privacy.json (the whole procedure's guarantee),
                              eval.json (the released trial's eval sets but val, and its noisy val score)
    OUT/summary.json          the same privacy report and eval sets, so that the folder reads as one finished run
                              (prismdp experiment with tune: {by: honest})

``resume=True`` continues from ``OUT/tune.json`` with the same drawn count and hyperparameters (a new draw after seeing
results would void the guarantee), skips finished trials and resumes an interrupted one from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..atomic import write_json
from ..privacy import check_delta
from ..privacy.tuning import TrialCount, calibrate_tuning_sigma, trial_accountant, trial_epsilon, tuning_epsilon
from ..train.config import ConfigError, TrainConfig

__all__ = ["Space", "TunePlan", "TuneResult", "Calibration", "calibrate", "check_tune_seed", "parse_trials",
           "plan_tuning", "run_tuning", "PLAN_FILE"]

PLAN_FILE = "tune.json"
SCORE_FILE = "score.json"
RELEASE = "release"
PAPER = "Papernot and Steinke, Hyperparameter Tuning with Renyi Differential Privacy, ICLR 2022"


@dataclass(frozen=True)
class Space:
    """The declared search space: each trial draws one value of each list, uniformly and independently."""

    lrs: tuple[float, ...]
    max_grad_norms: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.lrs:
            raise ConfigError("--lrs: give at least one learning rate, e.g. --lrs 1e-4,3e-4,1e-3")
        for name, values in (("lrs", self.lrs), ("max_grad_norms", self.max_grad_norms), ("ranks", self.ranks)):
            if any(isinstance(v, bool) or not v > 0 for v in values):
                raise ConfigError(f"--{name.replace('_', '-')}: every value must be > 0, got {list(values)}")
        if any(int(r) != r for r in self.ranks):
            raise ConfigError(f"--ranks: LoRA ranks are integers, got {list(self.ranks)}")

    def combinations(self) -> list[dict]:
        """Every point of the space, in order (``grid``)."""
        axes = [("lr", self.lrs), ("max_grad_norm", self.max_grad_norms), ("rank", self.ranks)]
        axes = [(k, v) for k, v in axes if v]
        return [dict(zip([k for k, _ in axes], map(_plain, values)))
                for values in itertools.product(*[v for _, v in axes])]

    def draw(self, rng: np.random.Generator) -> dict:
        out = {"lr": float(rng.choice(self.lrs))}
        if self.max_grad_norms:
            out["max_grad_norm"] = float(rng.choice(self.max_grad_norms))
        if self.ranks:
            out["rank"] = int(rng.choice(self.ranks))
        return out


def _plain(v):
    return int(v) if isinstance(v, int) else float(v)


def parse_trials(text: str, space: Space) -> tuple[TrialCount, bool]:
    """``--trials``: a :class:`TrialCount` spec, or ``grid`` (every combination of ``space`` once: a fixed count).
    Returns the count and whether it is the grid."""
    if str(text).strip() == "grid":
        return TrialCount.of("fixed", len(space.combinations())), True
    return TrialCount.parse(text), False


@dataclass
class TunePlan:
    """What ``OUT/tune.json`` holds: everything decided before the first trial."""

    base: dict  # the TrainConfig every trial starts from (its epsilon: the whole procedure's target)
    space: dict
    count: str  # the TrialCount, as parsed (e.g. geometric:8)
    distribution: dict  # TrialCount.describe()
    drawn: int
    draw_source: str  # "OS randomness" or "seeded generator (seed N)"
    trials: list  # per trial: its hyperparameters and seed
    noise_multiplier: float
    score_noise: float
    sample_rate: float
    steps: int
    dataset_size: int
    val_size: int
    epsilon: float  # the whole procedure's epsilon (at delta)
    trial_epsilon: float  # one trial's, by the same RDP accountant
    delta: float
    target_epsilon: float
    tune_seed: Optional[int] = None
    accountant: str = "rdp"  # of the whole tuning (rdp for a random count, the run's accountant for a fixed one)
    trial_accountant: str = "rdp"  # of trial_epsilon
    grid: bool = False  # every combination of the space once

    def save(self, path: Path) -> None:
        write_json(path, dataclasses.asdict(self))

    @classmethod
    def load(cls, path: Path) -> "TunePlan":
        return cls(**json.loads(path.read_text()))


@dataclass
class TuneResult:
    plan: TunePlan
    scores: dict  # trial index (1-based) -> noisy validation accuracy
    best: Optional[int]  # the released trial (None: K = 0, nothing released)
    output: Path


def _fail(msg: str):
    raise ConfigError(msg)  # the command line adds "prismdp tune: error: "


def check_tune_seed(tune_seed) -> None:
    """``--tune-seed``: None (OS randomness) or an integer >= 0 (numpy's seeds)."""
    if tune_seed is not None and (isinstance(tune_seed, bool) or not isinstance(tune_seed, int) or tune_seed < 0):
        _fail(f"--tune-seed must be an integer >= 0 (or left out: OS randomness), got {tune_seed!r}")


def _check_base(cfg: TrainConfig) -> None:
    if not cfg.dp:
        _fail("--no-dp: tuning inside a privacy budget needs a private run; tune a non-private run with prismdp "
              "experiment")
    if cfg.sigma is not None:
        _fail("--sigma: prismdp tune calibrates the per-trial noise to --epsilon (the whole tuning's "
              "target); leave it out")
    if cfg.lr is not None:
        _fail("--lr: the learning rate is tuned; give the candidates with --lrs")
    if not cfg.holdout_val:
        _fail("trials are scored on a validation split carved from the training data: add --holdout-val N (e.g. "
              "1000; GLUE tasks)")


_DATA_FREE = ("output", "method", "method_kwargs", "lr", "head_lr", "sigma", "epsilon", "max_grad_norm",
              "rank", "alpha", "dropout")  # settings that do not change the task data


def _dataset(cfg: TrainConfig) -> tuple[int, int]:
    """(training units, validation examples) of ``cfg``'s task, read with the tokenizer alone (no model weights);
    memoised per data-relevant settings (an experiment grid tunes many cells on the same data)."""
    return _dataset_of(json.dumps({k: v for k, v in cfg.to_dict().items() if k not in _DATA_FREE}, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _dataset_of(key: str) -> tuple[int, int]:
    cfg = TrainConfig.from_dict(json.loads(key))
    from ..models import load_tokenizer
    from ..train.tasks import build_task_data, task_head

    data = build_task_data(cfg, load_tokenizer(cfg.model, task_head(cfg)[0]))
    if "val" not in data.eval_sets:
        _fail(f"task {cfg.task!r} carves no validation split: holdout_val applies to GLUE classification tasks")
    return data.n_units, len(data.eval_sets["val"])


@dataclass(frozen=True)
class Calibration:
    """The per-trial noise for a total target, and what it gives; nothing drawn (``prismdp tune --dry-run``)."""

    dataset_size: int
    val_size: int
    sample_rate: float
    noise_multiplier: float
    epsilon: float  # the whole tuning's
    trial_epsilon: float
    accountant: str


def calibrate(cfg: TrainConfig, count: TrialCount, *, score_noise: float = 10.0,
              dataset: Optional[tuple[int, int]] = None) -> Calibration:
    """Check the settings and calibrate the per-trial noise multiplier to ``cfg.epsilon`` for the whole tuning.
    ``dataset``: (training units, validation size) if known, else read from the task."""
    _check_base(cfg)
    if not (isinstance(score_noise, (int, float)) and score_noise > 0):
        _fail(f"--score-noise must be > 0 (the noise multiplier of the validation count), got {score_noise!r}")
    n, n_val = dataset or _dataset(cfg)
    check_delta(cfg.delta, n, allow_large=cfg.allow_large_delta, unit=cfg.privacy_unit)
    q = cfg.batch_size / n
    if not 0 < q <= 1:
        _fail(f"--batch-size {cfg.batch_size:g} exceeds the {n} training examples left after the holdout")
    acc = cfg.accountant
    sigma = calibrate_tuning_sigma(cfg.epsilon, cfg.delta, q, cfg.steps, count, score_noise, accountant=acc)
    used = trial_accountant(count, acc)
    return Calibration(n, n_val, q, sigma, tuning_epsilon(sigma, q, cfg.steps, cfg.delta, count, score_noise, acc),
                       trial_epsilon(sigma, q, cfg.steps, cfg.delta, score_noise, used), used)


def plan_tuning(cfg: TrainConfig, space: Space, count: TrialCount, *, score_noise: float = 10.0,
                tune_seed: Optional[int] = None, dataset: Optional[tuple[int, int]] = None, grid: bool = False,
                log=print) -> TunePlan:
    """Check everything, calibrate the per-trial noise (:func:`calibrate`), draw K and every trial's hyperparameters.

    ``tune_seed``: seed of the draws (reproducible; stated in the plan); None draws them from OS randomness.
    ``grid``: every combination of the space once (``count`` must be ``fixed`` with that many trials)."""
    check_tune_seed(tune_seed)
    if grid and (count.random or int(count.mean) != len(space.combinations())):
        _fail(f"grid: the count must be fixed:{len(space.combinations())} (every combination once), got {count}")
    c = calibrate(cfg, count, score_noise=score_noise, dataset=dataset)
    rng = np.random.default_rng(tune_seed)  # None: fresh OS entropy
    drawn = count.sample(rng)
    points = space.combinations() if grid else [space.draw(rng) for _ in range(drawn)]
    trials = [{"index": i, **point, "seed": cfg.seed + i - 1} for i, point in enumerate(points, 1)]
    plan = TunePlan(
        base=cfg.to_dict(), space={k: list(v) for k, v in dataclasses.asdict(space).items()}, count=str(count),
        distribution=count.describe(), drawn=drawn,
        draw_source="OS randomness" if tune_seed is None else f"seeded generator (seed {tune_seed})",
        trials=trials, noise_multiplier=c.noise_multiplier, score_noise=float(score_noise), sample_rate=c.sample_rate,
        steps=cfg.steps, dataset_size=c.dataset_size, val_size=c.val_size, epsilon=c.epsilon,
        trial_epsilon=c.trial_epsilon, delta=cfg.delta, target_epsilon=cfg.epsilon, tune_seed=tune_seed,
        accountant=c.accountant, trial_accountant=c.accountant, grid=grid)
    log(f"[tune] {count} trials (mean {count.mean:g}): drew K = {drawn}; per-trial noise multiplier "
        f"{c.noise_multiplier:.4f} (one trial: epsilon {c.trial_epsilon:.3f}); whole tuning: epsilon {c.epsilon:.3f} "
        f"at delta {cfg.delta:g}")
    return plan


def _same_plan(saved: TunePlan, cfg: TrainConfig, space: Space, count: TrialCount, score_noise: float,
               grid: bool) -> list[str]:
    now = {"base": {**cfg.to_dict(), "output": saved.base["output"]},
           "space": {k: list(v) for k, v in dataclasses.asdict(space).items()},
           "trials": "grid" if grid else str(count), "score_noise": float(score_noise)}
    then = {"base": saved.base, "space": saved.space, "trials": "grid" if saved.grid else saved.count,
            "score_noise": saved.score_noise}
    diffs = [k for k in now if json.dumps(now[k], sort_keys=True) != json.dumps(then[k], sort_keys=True)]
    if "base" in diffs:
        diffs[diffs.index("base")] = "settings " + ", ".join(
            k for k in now["base"] if json.dumps(now["base"][k]) != json.dumps(saved.base.get(k)))
    return diffs


def trial_config(plan: TunePlan, trial: dict, out: Path) -> TrainConfig:
    """The trial's run: the base settings with its hyperparameters, seed and the calibrated noise multiplier."""
    values = {**plan.base, **{k: v for k, v in trial.items() if k != "index"},
              "sigma": plan.noise_multiplier, "output": str(out / f"trial-{trial['index']:03d}")}
    return TrainConfig.from_dict(values)


def _score(plan: TunePlan, folder: Path, index: int) -> float:
    """The trial's noisy validation accuracy, drawn once and kept in ``score.json``: (correct + N(0, s^2)) / n_val."""
    path = folder / SCORE_FILE
    if path.is_file():
        return json.loads(path.read_text())["score"]
    val = json.loads((folder / "summary.json").read_text())["eval"]["val"]
    correct = int(round(val["accuracy"] * val["n"]))
    rng = np.random.default_rng()  # always OS entropy: a stated seed would let anyone subtract the noise
    noisy = correct + float(rng.normal(0.0, plan.score_noise))
    score = noisy / plan.val_size
    write_json(path, {"score": score, "score_noise": plan.score_noise, "val_size": plan.val_size})
    return score


def release_report(plan: TunePlan, best: Optional[int], scores: dict, trial_privacy: Optional[dict]) -> dict:
    """The released run's privacy.json: the whole procedure's guarantee first, then one trial's and the count."""
    random = plan.distribution["family"] != "fixed"
    how = (f"K random ({PAPER}; Theorem 2, or Theorem 6 for a Poisson K), by dp_accounting's RDP accountant "
           "(RepeatAndSelectDpEvent)" if random else
           f"K fixed, the K trials composed by the {plan.accountant} accountant (an upper bound on releasing the best)")
    report = {
        "private": True, "epsilon": plan.epsilon, "delta": plan.delta, "target_epsilon": plan.target_epsilon,
        "guarantee": f"the whole tuning: the best of K trials, {how}",
        "accountant": plan.accountant,
        "per_trial": {"epsilon": plan.trial_epsilon, "delta": plan.delta, "accountant": plan.trial_accountant,
                      "noise_multiplier": plan.noise_multiplier, "sample_rate": plan.sample_rate,
                      "steps": plan.steps, "score_noise_multiplier": plan.score_noise,
                      "epsilon_trial_accountant": None if trial_privacy is None else trial_privacy.get("epsilon")},
        "trials": {"distribution": plan.distribution, "spec": plan.count, "drawn": plan.drawn,
                   "draw": plan.draw_source, "finished": len(scores)},
        "released": best is not None, "dataset_size": plan.dataset_size, "val_size": plan.val_size,
        "method": plan.base["method"],
    }
    if best is not None:
        trial = plan.trials[best - 1]
        # its hyperparameters, not its training seed (seeded noise could be regenerated from it)
        report["selected"] = {**{k: v for k, v in trial.items() if k != "seed"}, "noisy_val_accuracy": scores[best]}
        report["max_grad_norm"] = trial.get("max_grad_norm", plan.base["max_grad_norm"])
    return report


def _release(plan: TunePlan, out: Path, best: Optional[int], scores: dict) -> None:
    dest = out / RELEASE
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    trial_privacy, evals = None, {}
    if best is not None:
        folder = out / f"trial-{best:03d}"
        if (folder / "adapter").is_dir():
            shutil.copytree(folder / "adapter", dest / "adapter")
        summary = json.loads((folder / "summary.json").read_text())
        trial_privacy = summary.get("privacy")
        evals = {k: v for k, v in summary.get("eval", {}).items() if k != "val"}  # the exact val score: not covered
        evals["val_noisy"] = {"accuracy": scores[best], "n": plan.val_size}
        write_json(dest / "eval.json", evals)
    report = release_report(plan, best, scores, trial_privacy)
    write_json(dest / "privacy.json", report)
    # the tuning folder reads as one finished run (prismdp experiment's tables, tune: {by: honest}): the released
    # trial's public eval sets and the whole tuning's guarantee
    write_json(out / "summary.json", {"steps": plan.steps, "privacy": report, "eval": evals,
                                      "tuning": {"released": best, "trials": plan.drawn, "release": str(dest)}})


def _hyper(trial: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in trial.items() if k not in ("index", "seed"))


def run_tuning(cfg: TrainConfig, space: Space, count: TrialCount, *, score_noise: float = 10.0,
               tune_seed: Optional[int] = None, resume: bool = False, progress: bool = True, grid: bool = False,
               log: Callable[[str], None] = print, train_fn: Optional[Callable] = None,
               stop_after_trials: Optional[int] = None) -> TuneResult:
    """Plan (or, with ``resume``, reload the plan of) a tuning in ``cfg.output``, run its trials, release the best.

    ``stop_after_trials``: return after that many trials have finished (tests: an interrupted tuning)."""
    if train_fn is None:
        from ..train.loop import train as train_fn
    out = Path(cfg.output)
    path = out / PLAN_FILE
    if path.is_file():
        if not resume:
            _fail(f"{path} exists: continue that tuning with --resume (the same drawn count), or choose another "
                  "--output")
        plan = TunePlan.load(path)
        diffs = _same_plan(plan, cfg, space, count, score_noise, grid)
        if diffs:
            _fail(f"--resume with different {'; '.join(diffs)} than {path}; resume with the original settings")
        log(f"[tune] resuming: K = {plan.drawn} trials drawn ({plan.draw_source}), noise multiplier "
            f"{plan.noise_multiplier:.4f}")
    else:
        if resume:
            log(f"[tune] --resume: no {PLAN_FILE} in {out}; starting a new tuning")
        plan = plan_tuning(cfg, space, count, score_noise=score_noise, tune_seed=tune_seed, grid=grid, log=log)
        out.mkdir(parents=True, exist_ok=True)
        plan.save(path)  # before any trial: a stopped tuning resumes with this count
    scores = {}
    for trial in plan.trials:
        i, tcfg = trial["index"], trial_config(plan, trial, out)
        folder = Path(tcfg.output)
        tag = f"[tune] trial {i}/{plan.drawn} ({_hyper(trial)})"
        if (folder / "summary.json").is_file():
            log(f"{tag}: done, skipped")
        else:
            log(f"{tag}: training -> {folder}")
            train_fn(tcfg, resume=True, progress=progress, log=log)
        scores[i] = _score(plan, folder, i)
        log(f"{tag}: noisy val accuracy {scores[i]:.4f}")
        if stop_after_trials is not None and len(scores) >= stop_after_trials and len(scores) < plan.drawn:
            return TuneResult(plan, scores, None, out)
    best = max(scores, key=lambda i: (scores[i], -i)) if scores else None  # ties: the earlier trial
    _release(plan, out, best, scores)
    if best is None:
        log(f"[tune] K = 0 trials drawn: nothing released (the budget spent is that of the whole tuning: epsilon "
            f"{plan.epsilon:.3f}); {out / RELEASE / 'privacy.json'}")
    else:
        log(f"[tune] released trial {best} ({_hyper(plan.trials[best - 1])}); whole tuning: epsilon "
            f"{plan.epsilon:.3f} at delta {plan.delta:g}; publish {out / RELEASE} only")
    return TuneResult(plan, scores, best, out)
