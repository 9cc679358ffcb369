"""prismdp's maintained benchmarks (run ``python -m bench --help`` from the repository root); the one-off studies
are in :mod:`bench.studies` (docs/studies.md)."""

import subprocess
from pathlib import Path

from prismdp.quiet import install as _install_quiet

_install_quiet()  # before any benchmark imports peft / transformers: their harmless messages filtered (prismdp.quiet)

ROOT = Path(__file__).resolve().parents[1]


def code_commit() -> str:
    """The repository's commit, with "+ uncommitted changes" when the timed code (src/, bench/) differs from it;
    "unknown" outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src", "bench"],
                               capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return "unknown"
    return commit + (" + uncommitted changes" if dirty else "")
