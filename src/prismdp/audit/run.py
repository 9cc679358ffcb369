"""``prismdp audit``: one real training run with m canaries, and the epsilon lower bound it proves.

1. The auditor draws m fair coins from the operating system's CSPRNG (:mod:`secrets`): canary j is in the run iff its
   coin is 1 (:class:`InclusionSecret`).  The canaries themselves are public (a root seed, recorded in audit.json).
2. The run is an ordinary ``prismdp train`` run (:func:`prismdp.train.loop.train`) that also holds the included
   canaries: gradient canaries as an extra example source of the mechanism, input canaries as extra training
   examples (:mod:`.canaries`, :mod:`.inputs`).
3. Every canary is scored from what the run released (gradient: the noisy releases, through a step hook) or from the
   trained model (input: its loss against the base model's) -- by code that holds all m canaries and no coin.
4. Only then are the coins revealed: :func:`~prismdp.audit.statistics.audit_one_run` turns the scores of the
   included and excluded canaries into a lower bound on epsilon at the run's delta.  A bound above the accountant's
   epsilon means the run leaked more than its privacy report says: audit.json says so and the command exits 1.
5. The same scores also go through the f-DP test of :mod:`.fdp` (Mahloujifar et al. 2024): a Gaussian-DP mu (and
   its epsilon at delta), and the noise multiplier of the run's own mechanism family above which every claim is
   rejected (and the accountant's epsilon there); reported under ``"fdp"`` in audit.json, with its own verdict (the
   run's sigma rejected or not).  The command's verdict and exit code stay those of step 4.

What "out of the training process's reach" means here.  Training and auditing share one Python process, and nothing
in one process is out of reach of code that goes looking (``gc.get_objects()`` finds every object).  What this module
guarantees is structural: no object the trainer holds (model, optimizer, mechanism, data, the canary injector) refers
to the coins or to the excluded canaries; the trainer receives the included canaries only, as it receives its data.
The scorer is given all m canaries and no coins, and the scores are final (a numpy array, copied) before
:meth:`InclusionSecret.reveal` is called; the coins reach disk (audit-canaries.json) only after that.  A stronger
separation would run the scorer in another process; the statistics do not need it, because the guesses are a function
of the scores alone: the candidate thresholds (the top-k ladder) are fixed before the coins are read, and the
Bonferroni correction over them pays for choosing the best one after.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import numpy as np
import torch

from ..atomic import write_json
from ..privacy.accounting import epsilon as accountant_epsilon
from ..train.config import ConfigError, TrainConfig
from .canaries import CanaryInjector, CanarySet, layout_of
from .fdp import audit_one_run_fdp, audit_one_run_mechanism
from .inputs import canary_losses, make_input_canaries
from .scoring import GradientScorer
from .statistics import audit_one_run

__all__ = ["CANARY_KINDS", "InclusionSecret", "run_audit"]

CANARY_KINDS = ("gradient", "input")
INPUT_CANARY_TOKENS = 16  # length of an input canary (capped by max_length)


class InclusionSecret:
    """Which of m canaries are in the run: independent fair bits from the OS's CSPRNG (:func:`secrets.randbits`)."""

    def __init__(self, m: int):
        self.m = int(m)
        self._bits = np.array([secrets.randbits(1) for _ in range(self.m)], dtype=bool)
        self._handed_out = False

    def included(self) -> list[int]:
        """The included canaries' indices, handed out once: to build what the trainer holds."""
        if self._handed_out:
            raise RuntimeError("the included canaries were already handed out")
        self._handed_out = True
        return np.flatnonzero(self._bits).tolist()

    def reveal(self) -> np.ndarray:
        """The m inclusion bits: call only once every score is final."""
        return self._bits.copy()


def _check(cfg: TrainConfig, m: int, kind: str, significance: float) -> None:
    if kind not in CANARY_KINDS:
        raise ConfigError(f"canary_kind: must be one of {', '.join(CANARY_KINDS)}, got {kind!r}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 2:
        raise ConfigError(f"canaries: need an integer >= 2 (some in, some out), got {m!r}")
    if not 0 < significance < 0.5:
        raise ConfigError(f"significance: must be in (0, 0.5), got {significance!r}")
    if not cfg.dp:
        raise ConfigError("--no-dp: a non-private run has no privacy claim to audit (epsilon is infinite)")
    if cfg.privacy_unit != "example":
        raise ConfigError("privacy_unit: the audit's canaries are examples; audit with privacy_unit example")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("prismdp audit runs in one process (its canaries and scores are not split across ranks); "
                          "run it without torchrun")


def _check_output(out: Path) -> None:
    """An audit starts in a folder without a run: it cannot continue one (its inclusion bits live only in memory, and
    a checkpoint that held them would let the run see them)."""
    from ..train.run_folder import RunExistsError, RunFolder

    folder = RunFolder(out)
    held = (folder.checkpoint_path, folder.metrics_path, out / RunFolder.SUMMARY, out / "audit.json")
    if any(p.exists() for p in held):
        raise RunExistsError(f"{out} already holds a run; an audit cannot be resumed (its canaries' inclusion bits are "
                             "kept only in memory). Choose another --output, or delete the folder to audit again")


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None  # strict JSON has no Infinity


def fdp_report(in_scores: np.ndarray, out_scores: np.ndarray, privacy: dict, significance: float,
               threshold_rule: str = "ladder") -> dict:
    """audit.json's ``"fdp"`` section: the f-DP bounds of :mod:`.fdp` on the same scores, for the run's
    ``privacy`` summary (delta, sample rate, steps, noise multiplier, accountant)."""
    delta, sigma = privacy["delta"], float(privacy["noise_multiplier"])
    gdp = audit_one_run_fdp(in_scores, out_scores, delta=delta, significance=significance,
                            threshold_rule=threshold_rule)
    mech = audit_one_run_mechanism(in_scores, out_scores, sample_rate=privacy["sample_rate"], steps=privacy["steps"],
                                   delta=delta, significance=significance, start=sigma,
                                   threshold_rule=threshold_rule)
    s = mech.sigma_upper_bound
    eps = accountant_epsilon(s, privacy["sample_rate"], privacy["steps"], delta, privacy["accountant"]) \
        if np.isfinite(s) else 0.0
    return {
        "test": f"Mahloujifar, Melis, Chaudhuri 2024 (arXiv:2410.22235), Bonferroni over the {threshold_rule} "
                "thresholds",
        "gdp_mu_lower_bound": gdp.mu_lower_bound, "gdp_eps_lower_bound": gdp.eps_lower_bound,
        "gdp_guesses": gdp.guesses, "gdp_correct": gdp.correct, "gdp_threshold": _finite(gdp.threshold),
        "mechanism_sigma_upper_bound": _finite(s), "mechanism_eps_lower_bound": _finite(eps),
        "mechanism_guesses": mech.guesses, "mechanism_correct": mech.correct,
        "mechanism_threshold": _finite(mech.threshold),
        "verdict": "consistent" if s >= sigma else "violation",
    }


def run_audit(cfg: TrainConfig, canaries: int, kind: str = "gradient", *, significance: float = 0.05,
              progress: bool = True, log=print) -> dict:
    """Train ``cfg`` once with ``canaries`` canaries of ``kind``; write and return ``audit.json``'s content."""
    from ..train.loop import train

    _check(cfg, canaries, kind, significance)
    _check_output(Path(cfg.output))
    t0 = time.perf_counter()
    secret = InclusionSecret(canaries)
    root = secrets.randbits(62)  # public: the canaries themselves
    state: dict = {}

    if kind == "gradient":
        def setup(run) -> None:
            opt = run.private.optimizer
            public = CanarySet.first(layout_of(opt), root, canaries)
            injector = CanaryInjector(public.subset(secret.included()), run.private.data_sampler.sample_rate,
                                      run.private.dp.max_grad_norm,
                                      torch.Generator().manual_seed(secrets.randbits(63)))
            run.private.mechanism.attach_example_source(injector)
            state["scorer"] = GradientScorer(public, run.device)
            opt.attach_step_hook(state["scorer"])

        extend = None
    else:
        def extend(data, tokenizer, num_labels) -> None:
            examples = make_input_canaries(canaries, root, tokenizer, data.task_type, num_labels,
                                           min(INPUT_CANARY_TOKENS, cfg.max_length), data.train[0])
            state["examples"], state["loss"] = examples, data.loss
            data.train.extend(examples[j] for j in secret.included())

        def setup(run) -> None:
            state["pad"], state["device"] = run.tokenizer.pad_token_id, run.device
            state["base"] = canary_losses(run.model, state["examples"], state["loss"], state["pad"], run.device)

    result = train(cfg, progress=progress, log=log, setup=setup, extend_data=extend)
    if kind == "gradient":
        scores = state["scorer"].scores()
    else:
        trained = canary_losses(result.model, state["examples"], state["loss"], state["pad"], state["device"])
        scores = (state["base"] - trained).numpy()  # how much training lowered each canary's loss
    scores = np.array(scores, dtype=float, copy=True)  # final before the coins are read

    bits = secret.reveal()
    privacy = result.summary["privacy"]
    found = audit_one_run(scores[bits], scores[~bits], delta=privacy["delta"], significance=significance)
    claimed = float(privacy["epsilon"])
    report = {
        "m": canaries, "canary_kind": kind, "included": int(bits.sum()), "method": cfg.method,
        "guesses": found.guesses, "correct": found.correct, "threshold": found.threshold,
        "threshold_rule": "ladder", "candidate_thresholds": found.candidates, "eps_lower_bound": found.eps_lower_bound,
        "significance": significance, "delta": privacy["delta"], "epsilon": claimed,
        "accountant": privacy["accountant"], "noise_multiplier": privacy["noise_multiplier"],
        "sample_rate": privacy["sample_rate"], "steps": privacy["steps"], "canary_seed": root,
        "verdict": "consistent" if found.eps_lower_bound <= claimed else "violation",
        "fdp": fdp_report(scores[bits], scores[~bits], privacy, significance),
        "runtime_s": time.perf_counter() - t0,
    }
    out = Path(cfg.output)
    write_json(out / "audit-canaries.json", {"canary_seed": root, "kind": kind, "scores": scores.tolist(),
                                             "included": bits.astype(int).tolist()})
    write_json(out / "audit.json", report)
    return report
