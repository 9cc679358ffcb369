"""Arguments and driver of ``prismdp diagnose <which>`` (kept import-light: torch loads only when it runs)."""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

__all__ = ["NAMES", "add_arguments", "run", "run_diagnostic"]

NAMES = ("gauge-training", "gauge-sweep", "noise-vs-S", "amplification", "sigma-sweep")


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _mapping(text: str) -> dict:
    import yaml

    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping such as '{{preset: reference}}', got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=[*NAMES, "all"], help="the diagnostic to run (all = the five, one after another)")
    g = p.add_argument_group("run (as prismdp train; defaults: packaged MiniLM, built-in synthetic task)")
    g.add_argument("--model", help="local folder, hub id or .gguf file")
    g.add_argument("--task", help="synthetic (default), instruct, or a GLUE task")
    g.add_argument("--data", help="GLUE folder or LLM-Adapters JSON file")
    g.add_argument("--steps", type=int, help="steps per run (defaults: gauge-training 30, noise-vs-S 30, "
                   "amplification 60, sigma-sweep 120; gauge-sweep: length of the run whose tau is used, 60)")
    g.add_argument("--seeds", type=_ints, help="comma-separated seeds (default 42)")
    g.add_argument("--epsilon", type=float, help="target epsilon (default 3)")
    g.add_argument("--delta", type=float, help="delta (default 1e-5)")
    g.add_argument("--accountant", choices=["prv", "rdp", "pld"])
    g.add_argument("--rank", type=int, help="LoRA rank (default 8)")
    g.add_argument("--alpha", type=float, help="LoRA alpha (default 16)")
    g.add_argument("--dropout", type=float, help="LoRA dropout (default 0)")
    g.add_argument("--batch-size", dest="batch_size", type=float, help="expected Poisson batch size (default 32)")
    g.add_argument("--micro-batch-size", dest="micro_batch_size", type=int, help="default 32")
    g.add_argument("--max-length", dest="max_length", type=int, help="default 48")
    g.add_argument("--lr", type=float, help="learning rate of both methods (default: each method's default)")
    g.add_argument("--max-grad-norm", dest="max_grad_norm", type=float, help="clipping norm C (default 1)")
    g.add_argument("--target-modules", dest="target_modules", type=_names, help="comma-separated module names")
    g.add_argument("--train-examples", dest="train_examples", type=int, help="seeded subset of the training set")
    g.add_argument("--synthetic-train", dest="synthetic_train", type=int, help="size of the built-in task (2000)")
    g.add_argument("--init", choices=["spectral", "random"], help="PRISM's rank-r start (default spectral)")
    g.add_argument("--baseline-start", dest="baseline_start", choices=["peft", "rank-r"],
                   help="DP-AdamW's start: PEFT's init (default) or PRISM's rank-r start")
    g.add_argument("--prism-kwargs", dest="prism_kwargs", type=_mapping,
                   help="PRISM's options as a YAML mapping, e.g. '{preset: reference}' or '{floor_mode: geometry}'")
    d = p.add_argument_group("diagnostics")
    d.add_argument("--gauges", type=_floats, help="gauge scales c (default 0.25,0.5,1,2,4)")
    d.add_argument("--epsilons", type=_floats, help="sigma-sweep epsilons (default 1.5,3,6,12)")
    d.add_argument("--burn-in", dest="burn_in", type=int, help="sigma-sweep: steps discarded (default 10)")
    d.add_argument("--draws", type=int, help="gauge-sweep: Monte-Carlo draws per c (default 64)")
    d.add_argument("--sweep-points", dest="sweep_points", type=int, help="gauge-sweep: values of c (default 61)")
    d.add_argument("--sweep-decades", dest="sweep_decades", type=float, help="gauge-sweep: log10 c range (3)")
    d.add_argument("--sweep-source", dest="sweep_source", choices=["start", "random"],
                   help="gauge-sweep: a module after the rank-r start (default) or a random rank-r Z")
    d.add_argument("--module", help="gauge-sweep: module name substring (default: the largest S)")
    d.add_argument("--window", type=int, help="amplification: moving-average window (default 25)")
    p.add_argument("--output", help="output folder (default runs/diagnostics)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or log lines")


def run_diagnostic(name: str, settings, log=print):
    """Run one diagnostic; write ``<output>/<name>.png`` and ``.csv``; return ``(result, png, csv)``."""
    from .experiments import DIAGNOSTICS
    from .plots import save_figure
    from .runs import Session
    from .table import write_csv

    if name not in DIAGNOSTICS:
        raise ValueError(f"unknown diagnostic {name!r}; choose one of {', '.join(NAMES)}")
    out = Path(settings.output)
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers deprecation chatter
        session = Session(settings, log)
        res = DIAGNOSTICS[name](session)
    csv_path = write_csv(out / f"{name}.csv", res.caption, res.columns, res.rows)
    png_path = save_figure(res, out / f"{name}.png")
    return res, png_path, csv_path


def run(args: argparse.Namespace) -> int:
    from .runs import Settings

    values = {k: v for k, v in vars(args).items() if k not in ("command", "which", "quiet")}
    quiet = getattr(args, "quiet", False)
    values["progress"] = not quiet
    settings = Settings(**values)
    log = (lambda *a: None) if quiet else print
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    names = NAMES if args.which == "all" else (args.which,)
    for name in names:
        t0 = time.perf_counter()
        res, png, csv_path = run_diagnostic(name, settings, log)
        print(f"{name}: {png} and {csv_path} ({time.perf_counter() - t0:.0f} s)")
        for line in res.summary:
            print(f"  {line}")
    return 0
