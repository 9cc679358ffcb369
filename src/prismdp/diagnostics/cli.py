"""Arguments and driver of ``prismdp diagnose <which>`` (kept import-light: torch loads only when it runs)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..quiet import install as install_quiet

__all__ = ["NAMES", "add_arguments", "run", "run_diagnostic"]

NAMES = ("gauge-training", "gauge-sweep", "noise-vs-S", "amplification", "sigma-sweep")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``diagnose`` flags, generated from the fields of TrainConfig (:data:`~.settings.RUN_KEYS`, spelled and
    explained as for ``prismdp train``) and of :class:`~.settings.Settings`."""
    from ..flags import add_config_flags
    from ..train.config import TrainConfig
    from .settings import DIAGNOSTIC_KEYS, OWN_RUN_KEYS, RUN_DEFAULTS, RUN_KEYS, Settings

    p.add_argument("which", choices=[*NAMES, "all"], help="the diagnostic to run (all = the five, one after another)")
    g = p.add_argument_group("run (as prismdp train; defaults: packaged MiniLM, built-in synthetic task)")
    add_config_flags(g, TrainConfig, only=RUN_KEYS, defaults=RUN_DEFAULTS)
    add_config_flags(g, Settings, only=OWN_RUN_KEYS)
    add_config_flags(p.add_argument_group("diagnostics"), Settings, only=DIAGNOSTIC_KEYS)
    add_config_flags(p, Settings, only=("output", "progress"))


def run_diagnostic(name: str, settings, log=print):
    """Run one diagnostic; write ``<output>/<name>.png`` and ``.csv``; return ``(result, png, csv)``."""
    from .studies import DIAGNOSTICS
    from .plots import save_figure
    from .runs import Session
    from .table import write_csv

    if name not in DIAGNOSTICS:
        raise ValueError(f"unknown diagnostic {name!r}; choose one of {', '.join(NAMES)}")
    out = Path(settings.output)
    out.mkdir(parents=True, exist_ok=True)
    session = Session(settings, log)
    res = DIAGNOSTICS[name](session)
    csv_path = write_csv(out / f"{name}.csv", res.caption, res.columns, res.rows)
    png_path = save_figure(res, out / f"{name}.png")
    return res, png_path, csv_path


def run(args: argparse.Namespace) -> int:
    from .settings import Settings

    settings = Settings.from_dict({k: v for k, v in vars(args).items() if k not in ("command", "which")})
    quiet = not settings.progress
    log = (lambda *a: None) if quiet else print
    install_quiet(quiet=quiet)  # library messages known to be harmless (prismdp.quiet); --quiet: no loading bar
    names = NAMES if args.which == "all" else (args.which,)
    for name in names:
        t0 = time.perf_counter()
        res, png, csv_path = run_diagnostic(name, settings, log)
        print(f"{name}: {png} and {csv_path} ({time.perf_counter() - t0:.0f} s)")
        for line in res.summary:
            print(f"  {line}")
    return 0
