"""``prismdp`` command line: argument parsing only; the work happens in train/, privacy/, ...

    prismdp train [--config FILE] [flags]      DP LoRA fine-tuning (default: PRISM, MiniLM, built-in task, eps 3)
    prismdp epsilon --sigma S --sample-rate Q --steps T [--delta D]        epsilon of a run
    prismdp epsilon --target-epsilon E --sample-rate Q --steps T           calibrated sigma
    prismdp experiment CONFIG.yaml [--output OUT] [--set KEY=VALUE ...]    a grid of runs + Table-2 style tables
    prismdp audit [train flags] --canaries M [--canary-kind gradient|input]  one-run privacy audit (audit.json)
    prismdp tune [train flags] --lrs A,B,C --trials geometric:8 --epsilon E   tuning inside the budget (docs/tuning.md)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from .quiet import install as install_quiet

__all__ = ["main", "build_parser"]


def _add_train(sub) -> None:
    from .flags import add_config_flags, integer
    from .train.config import TrainConfig

    p = sub.add_parser("train", help="DP fine-tune a model with LoRA", argument_default=argparse.SUPPRESS,
                       description="Flags override --config; unset keys take TrainConfig's defaults.")
    p.add_argument("--config", help="YAML or JSON file with the same keys as the flags")
    add_config_flags(p, TrainConfig)
    p.add_argument("--resume", action="store_true", help="continue the run in --output from its checkpoint")
    p.add_argument("--stop-after", dest="stop_after", type=integer, help=argparse.SUPPRESS)  # simulate an interruption
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_audit(sub) -> None:
    from .audit.run import CANARY_KINDS
    from .flags import add_config_flags, finite_float, integer
    from .train.config import TrainConfig

    p = sub.add_parser("audit", help="one training run with canaries: an empirical lower bound on its epsilon",
                       argument_default=argparse.SUPPRESS,
                       description="Trains like `prismdp train` (same flags) with M canaries, each in the run with "
                                   "probability 1/2, scores them and writes OUTPUT/audit.json: the epsilon lower bound "
                                   "(Steinke, Nasr, Jagielski 2023) against the accountant's epsilon. Exits 1 if the "
                                   "bound exceeds it.")
    p.add_argument("--config", help="YAML or JSON file with the same keys as the flags")
    add_config_flags(p, TrainConfig)
    p.add_argument("--canaries", type=integer, default=1000, help="number of canaries m (default 1000)")
    p.add_argument("--canary-kind", dest="canary_kind", choices=CANARY_KINDS, default="gradient",
                   help="gradient (white-box: a gradient of norm C in a random direction, default) or input "
                        "(black-box: random tokens with random labels, scored by their loss)")
    p.add_argument("--significance", type=finite_float, default=0.05,
                   help="1 - confidence of the bound (default 0.05)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_epsilon(sub) -> None:
    from .flags import finite_float, integer

    p = sub.add_parser("epsilon", help="epsilon of a run, or the sigma that reaches a target epsilon")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--sigma", type=finite_float, help="noise multiplier")
    what.add_argument("--target-epsilon", type=finite_float, help="print the calibrated sigma instead")
    p.add_argument("--sample-rate", type=finite_float, required=True)
    p.add_argument("--steps", type=integer, required=True)
    p.add_argument("--delta", type=finite_float, default=1e-5)
    p.add_argument("--accountant", choices=["prv", "rdp", "pld"], default="prv",
                   help="Opacus' prv (default) or rdp, or Google dp-accounting's pld")
    p.add_argument("--dataset-size", type=integer,
                   help="N (training examples or users): refuse a delta at or above 1/N")
    p.add_argument("--allow-large-delta", action="store_true", help="accept a delta at or above 1/N")


def _add_experiment(sub) -> None:
    from .flags import csv_list

    p = sub.add_parser("experiment", help="run a grid (methods x epsilons x tasks x seeds) and tabulate it",
                       description="Trains every cell of the grid in CONFIG into OUT/<cell id>/ (finished cells are "
                                   "skipped, interrupted ones resumed) and writes OUT/results.csv, results.md and "
                                   "results.tex. See prismdp.experiment.grid for the file format.")
    p.add_argument("config", help="experiment YAML/JSON file (e.g. configs/paper-gemma3-4b.yaml)")
    p.add_argument("--output", help="OUT folder (default: the file's `output`)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a TrainConfig key in every cell (repeatable), e.g. --set steps=2")
    p.add_argument("--tasks", type=csv_list, help="only these grid task ids")
    p.add_argument("--methods", type=csv_list, help="only these methods")
    p.add_argument("--privacy", type=csv_list, help="only these settings (e.g. 3,non-dp)")
    p.add_argument("--seeds", type=csv_list, help="only these seeds (a tuned grid still trains its tuning runs, "
                   "at its tuning seed: they choose the rate)")
    p.add_argument("--dry-run", action="store_true", help="list the selected cells and whether they are done")
    p.add_argument("--tables-only", action="store_true", help="train nothing; rebuild the tables from OUT")
    p.add_argument("--results-from", action="append", default=[], metavar="CSV",
                   help="an earlier results.csv of this grid (repeatable): its cells count as done and are reported "
                        "from it (a grid split across machines, or run folders deleted)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


_TUNE_HELP = """\
Hyperparameter search inside the privacy budget. --epsilon/--delta bound the WHOLE procedure (every trial, its score
and the choice); the per-trial noise is calibrated to meet them. The number of trials K comes from --trials: drawn at
random (Papernot and Steinke, ICLR 2022: geometric:MEAN, ...), or fixed (grid: every candidate once; composed), once,
before any trial, and saved in OUTPUT/tune.json. Each trial takes a learning rate from --lrs (and a clipping bound /
rank from --max-grad-norms / --ranks, if given; drawn at random, or each in turn for grid), trains a full private
run like `prismdp train`, and is scored by a noisy accuracy on the validation split carved from the training data
(--holdout-val). The best trial is released in OUTPUT/release/ (adapter, eval.json, privacy.json with the whole
guarantee). Publish OUTPUT/release/ only: the trial folders and tune.json are private. A stopped tuning continues
with --resume (same K, finished trials skipped); --dry-run shows the per-trial noise a setting costs.

  prismdp tune --task sst2 --data DIR --holdout-val 1000 --steps 80 --batch-size 128 --epsilon 3 \\
      --lrs 3e-4,1e-3,3e-3,1e-2 --trials grid --output runs/tune-sst2

How much it costs, and what the guarantee means: docs/tuning.md."""


def _add_tune(sub) -> None:
    import dataclasses

    from .flags import add_config_flags, finite_float, finite_floats, integer, integers
    from .train.config import TrainConfig

    p = sub.add_parser("tune", help="tune hyperparameters inside the privacy budget (random search, random count)",
                       argument_default=argparse.SUPPRESS, description=_TUNE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML or JSON file with the same keys as the train flags")
    p.add_argument("--lrs", type=finite_floats, required=True, help="learning-rate candidates, e.g. 1e-4,3e-4,1e-3")
    p.add_argument("--trials", required=True,
                   help="the number of trials K: drawn from geometric:MEAN, negative-binomial:SHAPE:MEAN, "
                        "logarithmic:MEAN (K >= 1) or poisson:MEAN (K = 0 possible: nothing released), e.g. "
                        "geometric:6; or fixed:K (random draws) / grid (every combination once), a fixed K accounted "
                        "by composing the K trials (cheaper for a few short trials: docs/tuning.md)")
    p.add_argument("--epsilon", type=finite_float, help="target epsilon of the whole tuning (default 3)")
    p.add_argument("--max-grad-norms", dest="max_grad_norms", type=finite_floats, default=[],
                   help="clipping-bound candidates (default: --max-grad-norm for every trial)")
    p.add_argument("--ranks", type=integers, default=[],
                   help="LoRA-rank candidates (default: --rank for every trial)")
    p.add_argument("--score-noise", dest="score_noise", type=finite_float, default=10.0,
                   help="noise multiplier of each trial's validation count of correct answers (sensitivity 1; "
                        "default 10: +-1 point of accuracy on 1000 validation examples)")
    p.add_argument("--tune-seed", dest="tune_seed", type=integer, default=None,
                   help="seed the draws of K and the hyperparameters (reproducible, stated in privacy.json); "
                        "default: OS randomness. The score noise always comes from OS randomness")
    p.add_argument("--resume", action="store_true", help="continue the tuning in --output (same K and trials)")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="print the per-trial noise and the guarantee for these settings; draw and train nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    skip = {"lr", "sigma", "epsilon"}
    add_config_flags(p, TrainConfig, only=[f.name for f in dataclasses.fields(TrainConfig)
                                           if f.name not in skip and "help" in f.metadata])


def _add_diagnose(sub) -> None:
    from .diagnostics.cli import add_arguments

    p = sub.add_parser("diagnose", help="mechanism diagnostics: PRISM vs DP-AdamW (PNG + CSV)",
                       argument_default=argparse.SUPPRESS,
                       description="Paper Sec. 4 / App. C diagnostics; writes OUTPUT/<which>.png and .csv.")
    add_arguments(p)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line on stderr (exit status 2): ``prismdp train: error: ...``
    (``prismdp train --help`` shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prismdp", description="Differentially private LoRA with PRISM")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_epsilon(sub)
    _add_experiment(sub)
    _add_diagnose(sub)
    _add_audit(sub)
    _add_tune(sub)
    return parser


class _RunInterrupted(KeyboardInterrupt):
    """Ctrl-C outside the training loop's own handling; ``checkpointed``: the run folder holds a checkpoint."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed


def _continue_command(argv: list[str], command: str) -> str:
    """The command line that continues an interrupted run: ``argv`` with ``--resume`` (``train``), under ``torchrun``
    with the same number of processes (and nodes) when this process is one of a torchrun job."""
    resume = [] if "--resume" in argv or command != "train" else ["--resume"]  # experiments resume by themselves
    launcher = ["prismdp"]
    if "WORLD_SIZE" in os.environ:  # torchrun: a plain `prismdp train` would be refused by the world-size check
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nodes = ["--nnodes", str(world // local)] if world != local else []
        launcher = ["torchrun", *nodes, "--nproc-per-node", str(local), "-m", "prismdp"]
    return shlex.join([*launcher, *argv, *resume])


def _warnings_only(line, *args, **kwargs) -> None:
    """``--quiet``'s log: prismdp's warnings are kept, its informational lines dropped (the final lines are printed
    by the command itself)."""
    if "warning" in str(line):
        print(line, *args, **kwargs)


def _cmd_train(args: argparse.Namespace) -> int:
    from .train.config import TrainConfig, load_config_file
    from .train.interrupt import TrainingInterrupted
    from .train.loop import train
    from .train.run_folder import RunFolder

    values = load_config_file(args.config) if getattr(args, "config", None) else {}
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "resume", "stop_after", "quiet")}
    values.update(flags)
    cfg = TrainConfig.from_dict(values, source=args.config if getattr(args, "config", None) else "flags")
    if cfg.secure_noise and "seed" in values:
        print(f"prismdp train: --secure-noise: seed {values['seed']} seeds only the initialisation, dropout and data "
              "subsets; the noise and the Poisson sampling come from an OS-keyed ChaCha20 stream and take no seed",
              file=sys.stderr)
    try:
        quiet = getattr(args, "quiet", False)
        summary = train(cfg, resume=getattr(args, "resume", False), stop_after=getattr(args, "stop_after", None),
                        progress=not quiet, log=_warnings_only if quiet else print).summary
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt as e:  # a second Ctrl-C, or one before the training loop (loading, calibration)
        raise _RunInterrupted(RunFolder(cfg.output).checkpoint_path.is_file()) from e
    if "rank" in summary:  # another process of a multi-process run: rank 0 reports
        return 0
    if "interrupted_at" in summary:
        print(f"stopped after step {summary['interrupted_at']}; continue with --resume --output {cfg.output}")
        return 0
    privacy = summary["privacy"]
    eps = f"epsilon {privacy['epsilon']:.3f} (delta {privacy['delta']:g})" if privacy.get("private") else "non-private"
    for name, ev in summary.get("eval", {}).items():
        score = ev.get("accuracy", ev.get("score"))
        majority = f", majority class {ev['majority_baseline']:.4f}" if "majority_baseline" in ev else ""
        print(f"{name} accuracy {score:.4f} (n={ev['n']}{majority}) | {eps}")
    if not summary.get("eval"):
        print(eps)
    print(f"adapter, metrics and privacy report in {cfg.output}")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from .audit.run import run_audit
    from .train.config import TrainConfig, load_config_file

    own = ("command", "config", "canaries", "canary_kind", "significance", "quiet")
    values = load_config_file(args.config) if getattr(args, "config", None) else {}
    values.setdefault("output", "runs/prismdp-audit")
    values.update({k: v for k, v in vars(args).items() if k not in own})
    cfg = TrainConfig.from_dict(values, source=args.config if getattr(args, "config", None) else "flags")
    rep = run_audit(cfg, args.canaries, args.canary_kind, significance=args.significance,
                    progress=not getattr(args, "quiet", False))
    print(f"{rep['canary_kind']} canaries: {rep['correct']} of {rep['guesses']} guesses correct (m={rep['m']}); "
          f"epsilon >= {rep['eps_lower_bound']:.3f} at {1 - rep['significance']:.0%} confidence, accountant "
          f"{rep['epsilon']:.3f} (delta {rep['delta']:g}): {rep['verdict']} [{rep['runtime_s']:.0f} s, "
          f"{cfg.output}/audit.json]")
    f = rep["fdp"]
    if f["mechanism_sigma_upper_bound"] is None:  # no noise level rejected: nothing to bound
        rejected = "no noise level of the run's mechanism is rejected"
    else:
        eps = "inf" if f["mechanism_eps_lower_bound"] is None else f"{f['mechanism_eps_lower_bound']:.3f}"
        rejected = (f"the run's mechanism is rejected above noise {f['mechanism_sigma_upper_bound']:.3f} "
                    f"(epsilon >= {eps} by the accountant)")
    print(f"f-DP (Mahloujifar et al. 2024), same scores: mu >= {f['gdp_mu_lower_bound']:.3f} "
          f"(epsilon >= {f['gdp_eps_lower_bound']:.3f} as Gaussian DP); {rejected} (run's noise "
          f"{rep['noise_multiplier']:.3f}): {f['verdict']}")
    return 0 if rep["verdict"] == "consistent" else 1


def _cmd_epsilon(args: argparse.Namespace) -> int:
    from .privacy import calibrate_sigma, check_delta, epsilon
    from .privacy.accounting import accounting_note, vacuous_delta_error

    if args.dataset_size is not None:
        check_delta(args.delta, args.dataset_size, allow_large=args.allow_large_delta)
    try:
        if args.sigma is not None:
            value = epsilon(args.sigma, args.sample_rate, args.steps, args.delta, accountant=args.accountant)
            if value < 0:
                raise vacuous_delta_error(args.delta, args.accountant, f"epsilon {value:.3g}")
        else:
            value = calibrate_sigma(args.target_epsilon, args.delta, args.sample_rate, args.steps,
                                    accountant=args.accountant)
    except RuntimeError as e:  # Opacus' PRV: "Cannot compute epsilon" where delta exceeds what epsilon 0 gives
        raise vacuous_delta_error(args.delta, args.accountant, str(e)) from e
    sigma = args.sigma if args.sigma is not None else value
    note = accounting_note(sigma, args.sample_rate, args.steps, args.delta, args.accountant)
    print(f"{value:.6f}")
    if note:  # another accountant answered, or no meaningful guarantee: say which and why (stdout stays a number)
        print(f"prismdp epsilon: {note}", file=sys.stderr)
    return 0


def _cmd_experiment(args: argparse.Namespace) -> int:
    from .experiment import load_experiment, parse_set_overrides, parse_setting, run_experiment

    exp = load_experiment(args.config, parse_set_overrides(args.overrides))
    try:
        seeds = [int(s) for s in args.seeds] if args.seeds else None
    except ValueError:
        raise ValueError(f"--seeds: expected integers, got {args.seeds}") from None
    settings = [parse_setting(s) for s in args.privacy] if args.privacy else None
    run = run_experiment(exp, output=args.output, tasks=args.tasks, methods=args.methods, settings=settings,
                         seeds=seeds, dry_run=args.dry_run, tables_only=args.tables_only, progress=not args.quiet,
                         results_from=args.results_from)
    if run.table is not None:
        print((run.output / "results.md").read_text(), end="")
    for cell_id, why in run.failures.items():
        print(f"prismdp experiment: cell {cell_id} failed: {why}", file=sys.stderr)
    return 1 if run.failures else 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from .experiment.honest import Space, calibrate, check_tune_seed, parse_trials, run_tuning
    from .train.config import TrainConfig, load_config_file

    own = ("command", "config", "lrs", "trials", "max_grad_norms", "ranks", "score_noise", "tune_seed", "resume",
           "quiet", "dry_run")
    values = load_config_file(args.config) if getattr(args, "config", None) else {}
    values.setdefault("output", "runs/prismdp-tune")
    values.update({k: v for k, v in vars(args).items() if k not in own})
    if args.max_grad_norms and "max_grad_norm" in values or args.ranks and "rank" in values:
        raise ValueError("give a fixed value (--max-grad-norm / --rank) or candidates (--max-grad-norms / --ranks), "
                         "not both")
    cfg = TrainConfig.from_dict(values, source=args.config if getattr(args, "config", None) else "flags")
    space = Space(tuple(args.lrs), tuple(args.max_grad_norms), tuple(args.ranks))
    count, grid = parse_trials(args.trials, space)
    check_tune_seed(args.tune_seed)
    if getattr(args, "dry_run", False):
        c = calibrate(cfg, count, score_noise=args.score_noise)
        print(f"{'grid of ' if grid else ''}{count} trials: per-trial noise multiplier {c.noise_multiplier:.4f} "
              f"(one trial: epsilon {c.trial_epsilon:.3f}, {c.accountant}); whole tuning: epsilon {c.epsilon:.3f} "
              f"(delta {cfg.delta:g}); q = {c.sample_rate:.5g} ({c.dataset_size} training units, {c.val_size} val)")
        return 0
    res = run_tuning(cfg, space, count, score_noise=args.score_noise, tune_seed=args.tune_seed, grid=grid,
                     resume=getattr(args, "resume", False), progress=not getattr(args, "quiet", False))
    p = res.plan
    print(f"whole tuning: epsilon {p.epsilon:.3f} (delta {p.delta:g}) for {p.count} trials, K = {p.drawn}; "
          f"one trial: epsilon {p.trial_epsilon:.3f} ({p.trial_accountant}) at noise multiplier "
          f"{p.noise_multiplier:.4f}")
    if res.best is not None:
        print(f"released trial {res.best}: noisy val accuracy {res.scores[res.best]:.4f}; publish "
              f"{res.output / 'release'} only (the trial folders and tune.json are private)")
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from .diagnostics.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # under torchrun: a SIGTERM is never a silent death
        from .train.interrupt import guard_termination  # (first, before torch is imported: it takes seconds)

        guard_termination()
    install_quiet()  # first: optional backends log while they are imported (prismdp.quiet)
    from .distributed import PeerLostError, ReplicaDivergenceError, peer_lost
    from .models import ModelLoadError
    from .privacy import BudgetExhaustedError
    from .train.interrupt import TrainingInterrupted, last_word
    from .train.loop import RunExistsError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    install_quiet(quiet=getattr(args, "quiet", False))
    try:
        return {"train": _cmd_train, "epsilon": _cmd_epsilon, "experiment": _cmd_experiment,
                "diagnose": _cmd_diagnose, "audit": _cmd_audit, "tune": _cmd_tune}[args.command](args)
    except (ValueError, ImportError, FileNotFoundError, BudgetExhaustedError, ModelLoadError, RunExistsError,
            PeerLostError, ReplicaDivergenceError) as e:  # no traceback
        with last_word():  # (not beside the line of a multi-process run's SIGTERM watchdog)
            print(f"prismdp {args.command}: error: {e}", file=sys.stderr)
        if isinstance(e, PeerLostError) and peer_lost():  # a broken process group: its teardown at exit can block
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        return 2
    except TrainingInterrupted as e:  # Ctrl-C / SIGTERM during training: a checkpoint was saved after the last step
        if e.main:  # (only the reporting rank prints)
            line = (f"prismdp audit: stopped after step {e.step} of {e.total} ({e.signame}); an audit cannot be "
                    f"resumed (its canaries' inclusion bits were kept only in memory): delete {e.output} or choose "
                    "another --output to audit again" if args.command == "audit" else
                    f"prismdp {args.command}: stopped after step {e.step} of {e.total} ({e.signame}); checkpoint "
                    f"saved in {e.output}. Continue with:\n  {_continue_command(argv, args.command)}")
            with last_word():  # (not beside the line of a multi-process run's SIGTERM watchdog)
                print(line, file=sys.stderr)
        return 130
    except _RunInterrupted as e:
        hint = (f"; continue from its last checkpoint with:\n  {_continue_command(argv, args.command)}"
                if e.checkpointed else " before its first checkpoint (nothing to resume): run the same command again "
                                       "to start over")
        print(f"prismdp {args.command}: interrupted{hint}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"prismdp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
