"""The paired comparisons of an experiment as a figure (``paired.png``): one panel per task column, one row per
(privacy setting, method), the per-seed differences ``compare`` minus ``method`` as dots, their mean with a bar of
one sample standard deviation, and the zero line.  Right of zero: PRISM ahead on that seed.  Needs matplotlib (the
``plots`` extra); the tables do not."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import List, Sequence, Tuple

from .columns import COLUMN_LABELS
from .grid import Experiment
from .records import Pair

__all__ = ["have_matplotlib", "paired_figure", "save_paired_figure"]

_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _rows(exp: Experiment, pairs: Sequence[Pair]) -> List[Tuple[str, str]]:
    """(setting key, method) of every row some panel has, settings then methods in the experiment's order."""
    present = {(p.setting.key, p.method) for p in pairs}
    return [(st.key, m) for st in exp.settings for m in exp.methods if (st.key, m) in present]


def paired_figure(exp: Experiment, pairs: Sequence[Pair]):
    """The matplotlib figure (Agg backend), not saved: panel ``i`` is the ``i``-th task column of ``pairs``; row
    ``j`` from the top is ``_rows(exp, pairs)[j]``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(p.name for p in pairs))
    rows = _rows(exp, pairs)
    y_of = {r: len(rows) - 1 - j for j, r in enumerate(rows)}
    settings = [st for st in exp.settings if any(p.setting.key == st.key for p in pairs)]
    color = {st.key: _COLORS[i % len(_COLORS)] for i, st in enumerate(settings)}
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names) + 2.2, 0.32 * len(rows) + 1.6),
                             sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        ax.axvline(0.0, color="0.3", lw=0.8)
        for p in (q for q in pairs if q.name == name):
            y = y_of[(p.setting.key, p.method)]
            c = color[p.setting.key]
            ax.scatter(p.diffs, [y] * len(p.diffs), s=14, color=c, alpha=0.55, zorder=2)
            mean = statistics.fmean(p.diffs)
            sd = statistics.stdev(p.diffs) if len(p.diffs) > 1 else 0.0
            ax.errorbar([mean], [y], xerr=[sd], fmt="D", ms=5, color=c, mec="black", mew=0.6, capsize=2, zorder=3)
        ax.set_title(COLUMN_LABELS.get(name, name), fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlabel(f"{exp.label(exp.compare)} minus method", fontsize=8)
    axes[0][0].set_yticks([y_of[r] for r in rows])
    axes[0][0].set_yticklabels([f"{next(st.label for st in settings if st.key == k)}  {exp.label(m)}"
                                for k, m in rows], fontsize=8)
    axes[0][0].set_ylim(-0.6, len(rows) - 0.4)
    fig.suptitle(f"{exp.name}: paired by seed (dots), mean ± sd (diamond)", fontsize=10)
    fig.tight_layout()
    return fig


def save_paired_figure(exp: Experiment, pairs: Sequence[Pair], path: Path) -> Path:
    from ..atomic import atomic_path

    fig = paired_figure(exp, pairs)
    import matplotlib.pyplot as plt

    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return Path(path)
