"""Budget curves: the same task trained for different numbers of steps (grid task ids such as ``sst2`` at 80 steps
and ``sst2-x4: {task: sst2, steps: 320}``), each method's reported score against its step budget, per privacy setting,
paired by seed.  Does ``compare``'s lead grow, shrink or flip with the number of steps?

``budget_points`` reads them from the finished cells, ``render_budget`` writes the table of results.md and
``budget_figure`` the figure (``budget.png``: one panel per task, score against steps on a log axis, one colour per
method, one line style per setting, each seed a dot, the mean a line).  Only tasks trained at two or more budgets
appear."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .columns import COLUMN_LABELS
from .grid import Cell, Experiment
from .records import CellResult, mean_sd

__all__ = ["BudgetPoint", "budget_points", "render_budget", "budget_figure", "save_budget_figure"]


@dataclass(frozen=True)
class BudgetPoint:
    """One method's reported scores on one task, setting and step budget, by seed."""

    task: str  # the trained task (``sst2``), not the grid's task id
    setting_key: str
    method: str
    steps: int
    scores: Dict[int, float]  # seed -> the task's own score column


def budget_points(exp: Experiment, cells: Sequence[Cell], results: Sequence[CellResult]) -> List[BudgetPoint]:
    """Every (task, setting, method, steps) with a result, for the tasks that the grid trains at two or more step
    budgets; ordered by task (grid order), setting, method, steps."""
    by_cell = {r.cell.id: r for r in results}
    scores: Dict[Tuple[str, str, str, int], Dict[int, float]] = {}
    for c in cells:
        r = by_cell.get(c.id)
        task = c.config.task
        if r is None or task not in r.scores:
            continue
        scores.setdefault((task, c.setting.key, c.method, int(c.config.steps)), {})[c.seed] = r.scores[task]
    budgets: Dict[str, set] = {}
    for task, _, _, steps in scores:
        budgets.setdefault(task, set()).add(steps)
    tasks = [t for t in dict.fromkeys(c.config.task for c in cells) if len(budgets.get(t, ())) >= 2]
    out = []
    for task in tasks:
        for st in exp.settings:
            for method in exp.methods:
                for steps in sorted(budgets[task]):
                    got = scores.get((task, st.key, method, steps))
                    if got:
                        out.append(BudgetPoint(task, st.key, method, steps, dict(sorted(got.items()))))
    return out


def render_budget(exp: Experiment, points: Sequence[BudgetPoint]) -> str:
    """The budget table: per task, setting and step budget, each method's mean ± sample std over seeds and, when
    the grid has ``compare``, ``compare`` minus each other method paired by seed (mean, wins)."""
    if not points:
        return ""
    settings = {st.key: st for st in exp.settings}
    methods = [m for m in exp.methods if any(p.method == m for p in points)]
    ours = exp.compare if exp.compare in methods else None
    others = [m for m in methods if m != ours] if ours else []
    head = " | ".join(exp.label(m) for m in methods)
    diff_head = "".join(f" | {exp.label(ours)} − {exp.label(m)} | wins" for m in others)
    lines = ["", "## Step budget: score against the number of steps", "",
             "Tasks trained at several step budgets (the same batch size and privacy target, rates tuned per budget): "
             "mean ± sample std over seeds" + (f"; {exp.label(ours)} minus each method paired by seed, wins = seeds "
                                               f"where {exp.label(ours)} scores higher" if ours else "") + ".", "",
             f"| Task | Setting | Steps | {head}{diff_head} |",
             "|---|---|---:|" + "---:|" * len(methods) + "---:|---:|" * len(others)]
    keyed = {(p.task, p.setting_key, p.method, p.steps): p.scores for p in points}
    rows = dict.fromkeys((p.task, p.setting_key, p.steps) for p in points)
    for task, skey, steps in rows:
        got = {m: keyed.get((task, skey, m, steps), {}) for m in methods}
        cells = " | ".join(mean_sd(list(got[m].values())) for m in methods)
        diffs = ""
        for m in others:
            seeds = [s for s in got[ours] if s in got[m]]
            d = [got[ours][s] - got[m][s] for s in seeds]
            diffs += f" | {statistics.fmean(d):+.3f} | {sum(x > 0 for x in d)}/{len(d)}" if d else " | – | –"
        lines.append(f"| {COLUMN_LABELS.get(task, task)} | {settings[skey].label} | {steps} | {cells}{diffs} |")
    return "\n".join(lines) + "\n"


_COLORS = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:orange"]
_STYLES = ["-", "--", ":", "-."]


def budget_figure(exp: Experiment, points: Sequence[BudgetPoint]):
    """The matplotlib figure (Agg backend), not saved: panel ``i`` is the ``i``-th task of ``points``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(p.task for p in points))
    methods = list(dict.fromkeys(p.method for p in points))
    skeys = [st.key for st in exp.settings if any(p.setting_key == st.key for p in points)]
    labels = {st.key: st.label for st in exp.settings}
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, method in enumerate(methods):
            for j, skey in enumerate(skeys):
                pts = [p for p in points if p.task == task and p.method == method and p.setting_key == skey]
                if not pts:
                    continue
                color, style = _COLORS[i % len(_COLORS)], _STYLES[j % len(_STYLES)]
                for p in pts:
                    ax.scatter([p.steps] * len(p.scores), list(p.scores.values()), s=12, color=color, alpha=0.5)
                ax.plot([p.steps for p in pts], [statistics.fmean(p.scores.values()) for p in pts], style,
                        color=color, marker="o", ms=4, label=f"{exp.label(method)} {labels[skey]}")
        ax.set_xscale("log", base=2)
        steps = sorted({p.steps for p in points if p.task == task})
        ax.set_xticks(steps)
        ax.set_xticklabels([str(s) for s in steps])
        ax.set_title(COLUMN_LABELS.get(task, task), fontsize=10)
        ax.set_xlabel("steps", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("reported score", fontsize=8)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{exp.name}: score against step budget (dots: seeds, lines: means)", fontsize=10)
    fig.tight_layout()
    return fig


def save_budget_figure(exp: Experiment, points: Sequence[BudgetPoint], path: Path) -> Path:
    from ..atomic import atomic_path

    fig = budget_figure(exp, points)
    import matplotlib.pyplot as plt

    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return Path(path)
