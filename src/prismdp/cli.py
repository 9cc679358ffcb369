"""``prismdp`` command line: argument parsing only; the work happens in train/, privacy/, ...

    prismdp train [--config FILE] [flags]      DP LoRA fine-tuning (default: PRISM, MiniLM, built-in task, eps 3)
    prismdp epsilon --sigma S --sample-rate Q --steps T [--delta D]        epsilon of a run
    prismdp epsilon --target-epsilon E --sample-rate Q --steps T           calibrated sigma
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="DP fine-tune a model with LoRA", argument_default=argparse.SUPPRESS,
                       description="Flags override --config; unset keys take TrainConfig's defaults.")
    p.add_argument("--config", help="YAML or JSON file with the same keys as the flags")
    p.add_argument("--model", help="local folder, hub id or .gguf file (default: packaged MiniLM / SmolLM2)")
    p.add_argument("--task", help="synthetic (built-in, default), instruct, or a GLUE task (sst2, cola, mrpc, ...)")
    p.add_argument("--data", help="GLUE folder or LLM-Adapters JSON file")
    p.add_argument("--method", help="prism (default), dp-adamw, ...")
    p.add_argument("--no-dp", dest="dp", action="store_false", help="non-private run with the same method")
    p.add_argument("--epsilon", type=float, help="target epsilon (default 3)")
    p.add_argument("--delta", type=float, help="delta (default 1e-5)")
    p.add_argument("--accountant", choices=["prv", "rdp"])
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", dest="batch_size", type=float, help="expected logical batch size")
    p.add_argument("--micro-batch-size", dest="micro_batch_size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--rank", type=int)
    p.add_argument("--alpha", type=float)
    p.add_argument("--dropout", type=float)
    p.add_argument("--target-modules", dest="target_modules", type=_csv, help="comma-separated module names")
    p.add_argument("--max-grad-norm", dest="max_grad_norm", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-length", dest="max_length", type=int)
    p.add_argument("--train-on-inputs", dest="train_on_inputs", action="store_true")
    p.add_argument("--init", choices=["spectral", "random"], help="PRISM's rank-r start")
    p.add_argument("--train-examples", dest="train_examples", type=int, help="seeded subset of the training set")
    p.add_argument("--eval-examples", dest="eval_examples", type=int)
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int)
    p.add_argument("--output", help="run folder (default runs/prismdp)")
    p.add_argument("--resume", action="store_true", help="continue the run in --output from its checkpoint")
    p.add_argument("--stop-after", dest="stop_after", type=int, help=argparse.SUPPRESS)  # simulate an interruption
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_epsilon(sub) -> None:
    p = sub.add_parser("epsilon", help="epsilon of a run, or the sigma that reaches a target epsilon")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--sigma", type=float, help="noise multiplier")
    what.add_argument("--target-epsilon", type=float, help="print the calibrated sigma instead")
    p.add_argument("--sample-rate", type=float, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--accountant", choices=["prv", "rdp"], default="prv")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prismdp", description="Differentially private LoRA with PRISM")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_epsilon(sub)
    return parser


def _cmd_train(args: argparse.Namespace) -> int:
    from .train.config import TrainConfig, load_config_file
    from .train.loop import train

    values = load_config_file(args.config) if getattr(args, "config", None) else {}
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "resume", "stop_after", "quiet")}
    values.update(flags)
    cfg = TrainConfig.from_dict(values, source=args.config if getattr(args, "config", None) else "flags")
    summary = train(cfg, resume=getattr(args, "resume", False), stop_after=getattr(args, "stop_after", None),
                    progress=not getattr(args, "quiet", False)).summary
    if "interrupted_at" in summary:
        print(f"stopped after step {summary['interrupted_at']}; continue with --resume --output {cfg.output}")
        return 0
    privacy = summary["privacy"]
    eps = f"epsilon {privacy['epsilon']:.3f} (delta {privacy['delta']:g})" if privacy.get("private") else "non-private"
    for name, ev in summary.get("eval", {}).items():
        score = ev.get("accuracy", ev.get("score"))
        print(f"{name} accuracy {score:.4f} (n={ev['n']}, majority class {ev.get('majority_baseline', float('nan')):.4f})"
              f" | {eps}")
    if not summary.get("eval"):
        print(eps)
    print(f"adapter, metrics and privacy report in {cfg.output}")
    return 0


def _cmd_epsilon(args: argparse.Namespace) -> int:
    from .privacy import calibrate_sigma, epsilon

    if args.sigma is not None:
        print(f"{epsilon(args.sigma, args.sample_rate, args.steps, args.delta, accountant=args.accountant):.6f}")
    else:
        print(f"{calibrate_sigma(args.target_epsilon, args.delta, args.sample_rate, args.steps, accountant=args.accountant):.6f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .models import ModelLoadError
    from .privacy import BudgetExhaustedError
    from .train.loop import RunExistsError

    args = build_parser().parse_args(argv)
    try:
        return {"train": _cmd_train, "epsilon": _cmd_epsilon}[args.command](args)
    except (ValueError, ImportError, FileNotFoundError, BudgetExhaustedError, ModelLoadError, RunExistsError) as e:  # no traceback
        print(f"prismdp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
