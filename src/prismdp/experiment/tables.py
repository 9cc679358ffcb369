"""Results of an experiment grid: ``results.csv`` (one row per cell and metric) and the Table-2 style
``results.md`` / ``results.tex`` (rows: privacy setting x method; columns: per-task scores and their unweighted
average ``Avg``; bold = best per column within a setting; mean ± sample standard deviation over seeds when
there are several).

The per-task number is read from the run's ``summary.json`` ``eval`` by
:func:`prismdp.experiment.columns.table_scores` (a ``scores`` entry of runs written before takes its place; the
paper's convention, see :mod:`prismdp.eval.metrics`: CoLA MCC, MRPC/QQP (F1 + acc)/2, STS-B (Pearson +
Spearman)/2, MNLI mean of matched and mismatched accuracy, math exact-answer accuracy, otherwise accuracy).  ``Avg``
is computed per seed over the columns that seed has, then aggregated over seeds; a row missing some of the table's
columns gets a dagger.  Eval sets that a run could not evaluate (e.g. QQP validation, absent from the offline data)
keep their column, shown as ``–``, and are listed under the table.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..atomic import atomic_path, write_text
from ..train.profile import WARMUP_STEPS
from .budget import budget_points, render_budget, save_budget_figure
from .columns import CANONICAL, COLUMN_LABELS, GROUPS
from .figure import have_matplotlib, save_paired_figure
from .grid import Cell, Experiment, Setting
from .parts import render_parts
from .records import CellResult, Pair, read_cell

__all__ = ["CellResult", "Pair", "paired_differences", "read_cell", "result_rows", "write_csv", "build_table",
           "render_markdown", "render_latex", "render_pooled", "render_pooled_by", "render_privacy_cost",
           "write_results", "COLUMN_LABELS",
           "CSV_FIELDS"]

CSV_FIELDS = ["cell_id", "task_id", "task", "method", "method_label", "setting", "dp", "epsilon_target", "seed",
              "lr", "column", "metric", "value", "epsilon_spent", "delta", "noise_multiplier", "steps", "mean_step_time_s",
              "peak_memory_mb", "eval_time_s", "model"]
_DETAIL_METRICS = ("accuracy", "f1", "majority_baseline", "mcc", "pearson", "spearman", "correct", "n", "unparsed",
                   "parse_rate", "unfinished", "total")


def result_rows(exp: Experiment, results: Sequence[CellResult]) -> List[Dict[str, Any]]:
    """CSV rows: per cell, one ``metric=score`` row per table column, then the detailed metrics per eval set."""
    rows = []
    for r in results:
        c = r.cell
        priv = r.summary.get("privacy", {})
        common = {
            "cell_id": c.id, "task_id": c.task_id, "task": c.config.task, "method": c.method,
            "method_label": exp.label(c.method), "setting": c.setting.key, "dp": c.setting.dp,
            "epsilon_target": c.setting.epsilon if c.setting.dp else "", "seed": c.seed,
            "lr": r.config.get("lr", c.config.lr) or "",
            "epsilon_spent": priv.get("epsilon", "") if priv.get("private") else "",
            "delta": priv.get("delta", "") if priv.get("private") else "",
            "noise_multiplier": priv.get("noise_multiplier", "") if priv.get("private") else "",
            "steps": r.summary.get("steps", ""),
            "mean_step_time_s": "" if r.mean_step_time_s is None else r.mean_step_time_s,
            "peak_memory_mb": "" if r.peak_memory_mb is None else r.peak_memory_mb,
            "eval_time_s": r.summary.get("eval_time_s", ""), "model": r.config.get("model", c.config.model) or "",
        }
        for col, v in r.scores.items():
            rows.append({**common, "column": col, "metric": "score", "value": v})
        for set_name, ev in (r.summary.get("eval") or {}).items():
            for k in _DETAIL_METRICS:
                v = ev.get(k) if isinstance(ev, dict) else None
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    rows.append({**common, "column": set_name, "metric": k, "value": v})
    return rows


def write_csv(path: Path, rows: Sequence[Dict[str, Any]]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for row in rows:
            w.writerow(row)


# ----------------------------------------------------------------------------------------------------------------
# the Table-2 layout


@dataclass
class Stat:
    mean: float
    std: Optional[float]  # sample standard deviation over seeds (None for one seed)
    n: int


def _stat(values: Sequence[float]) -> Optional[Stat]:
    if not values:
        return None
    return Stat(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None, len(values))


@dataclass
class Row:
    method: str
    label: str
    cells: Dict[str, Stat]
    avg: Optional[Stat]
    incomplete: bool  # lacks a column that other rows have
    bold: set = field(default_factory=set)


@dataclass
class Table:
    title: str
    columns: List[str]
    blocks: List[Tuple[Setting, List[Row]]]
    n_seeds: int
    missing: Dict[str, str]  # eval sets no run could evaluate -> reason
    pending: List[str]  # cells without results
    failures: Dict[str, str]


def _column_order(exp: Experiment, present: Sequence[str]) -> List[str]:
    if exp.columns:
        return list(exp.columns) + [c for c in present if c not in exp.columns]
    known = [c for c in CANONICAL if c in present]
    return known + [c for c in present if c not in known]


def _column_scores(cells: Sequence[Cell]):
    """``result -> {column: score}``.  Task ids that train the same task (e.g. one task at two learning rates) would
    write the same columns: their columns are named by the task id instead (``sst2-lr1x``, ``id:column``)."""
    ids: Dict[str, set] = {}
    for c in cells:
        ids.setdefault(c.config.task, set()).add(c.task_id)

    def scores(r: CellResult) -> Dict[str, float]:
        c = r.cell
        if len(ids.get(c.config.task, ())) <= 1:
            return r.scores
        return {(c.task_id if col == c.config.task else f"{c.task_id}:{col}"): v for col, v in r.scores.items()}

    return scores


def build_table(exp: Experiment, cells: Sequence[Cell], results: Sequence[CellResult],
                failures: Optional[Dict[str, str]] = None) -> Table:
    by_cell = {r.cell.id: r for r in results}
    col_scores = _column_scores(cells)
    present: List[str] = []
    missing: Dict[str, str] = {}
    for r in results:
        present.extend(c for c in col_scores(r) if c not in present)
        for set_name, reason in r.missing.items():
            col = "mnli" if set_name.startswith("mnli_") else set_name
            missing.setdefault(set_name, reason)
            if col not in present:
                present.append(col)
    columns = _column_order(exp, present)
    with_values = {c for r in results for c in col_scores(r)}  # columns some run has (QQP may have none)
    blocks = []
    seeds_seen = set()
    for setting in exp.settings:
        rows = []
        for method in exp.methods:
            per_seed: Dict[int, Dict[str, float]] = {}
            for c in cells:
                if c.method != method or c.setting != setting or c.id not in by_cell:
                    continue
                per_seed.setdefault(c.seed, {}).update(col_scores(by_cell[c.id]))
            if not per_seed:
                continue
            seeds_seen.update(per_seed)
            stats = {col: _stat([s[col] for s in per_seed.values() if col in s]) for col in columns}
            stats = {k: v for k, v in stats.items() if v is not None}
            avgs = [statistics.fmean([s[c] for c in columns if c in s]) for s in per_seed.values()
                    if any(c in s for c in columns)]
            incomplete = any(col not in s for s in per_seed.values() for col in columns if col in with_values)
            rows.append(Row(method, exp.label(method), stats, _stat(avgs), incomplete))
        if len(rows) >= 2:
            for key in [*columns, "__avg__"]:
                if key == "__avg__":  # an Avg over fewer columns (dagger) is not comparable: complete rows only
                    cands = [(r.avg, r) for r in rows if not r.incomplete]
                else:
                    cands = [(r.cells.get(key), r) for r in rows]
                vals = [(round(stat.mean, 3), r) for stat, r in cands if stat is not None]
                if vals:
                    best = max(v for v, _ in vals)
                    for v, r in vals:
                        if v == best:
                            r.bold.add(key)
        if rows:
            blocks.append((setting, rows))
    pending = [c.id for c in cells if c.id not in by_cell and c.id not in (failures or {})]
    return Table(exp.name, columns, blocks, len(seeds_seen), missing, pending, dict(failures or {}))


def _fmt(s: Optional[Stat], pm: str) -> str:
    if s is None or s.mean is None or (isinstance(s.mean, float) and math.isnan(s.mean)):
        return "–"
    return f"{s.mean:.3f}" if s.std is None else f"{s.mean:.3f}{pm}{s.std:.3f}"


def _caption(t: Table) -> str:
    seeds = (f"mean ± sample std over {t.n_seeds} seeds" if t.n_seeds > 1 else "one seed")
    return (f"Rows: privacy setting x method; Avg = unweighted mean of the columns shown (per seed, then over "
            f"seeds); bold = best per column within a setting; {seeds}.")


def _notes(t: Table, tex: bool = False) -> List[str]:
    notes = []
    if any(r.incomplete for _, rows in t.blocks for r in rows):
        notes.append("† Avg over the columns this row has (some columns missing; not in the running for the bold Avg).")
    for k, v in t.missing.items():
        notes.append(f"{COLUMN_LABELS.get(k, k)} ({k}) not evaluated: {v}")
    if t.pending:
        notes.append(f"{len(t.pending)} grid cell(s) without results yet: {', '.join(t.pending[:8])}"
                     + (" ..." if len(t.pending) > 8 else ""))
    for k, v in t.failures.items():
        notes.append(f"cell {k} failed: {v}")
    return notes


def render_markdown(t: Table) -> str:
    cols = [COLUMN_LABELS.get(c, c) for c in t.columns]
    lines = [f"# {t.title}", "", _caption(t), "",
             "| Setting | Method | " + " | ".join(cols) + " | Avg |",
             "|---|---|" + "---:|" * (len(cols) + 1)]

    def cell(s: Optional[Stat], bold: bool, dagger: str = "") -> str:
        text = _fmt(s, " ± ") + dagger
        return f"**{text}**" if bold and s is not None else text

    for setting, rows in t.blocks:
        for i, r in enumerate(rows):
            vals = [cell(r.cells.get(c), c in r.bold) for c in t.columns]
            vals.append(cell(r.avg, "__avg__" in r.bold, "†" if r.incomplete else ""))
            lines.append(f"| {setting.label if i == 0 else ''} | {r.label} | " + " | ".join(vals) + " |")
    notes = _notes(t)
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _tex_escape(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("$", r"\$"), ("#", r"\#"),
                 ("_", r"\_"), ("{", r"\{"), ("}", r"\}"), ("±", r"$\pm$"), ("–", "--"), ("†", r"$^\dagger$")):
        s = s.replace(a, b)
    return s


def render_latex(t: Table) -> str:
    n = len(t.columns)
    group_of = {c: g for g, cs in GROUPS for c in cs}
    runs: List[Tuple[Optional[str], int, int]] = []  # (group, first col index, last col index), 1-based in data
    for i, c in enumerate(t.columns):
        g = group_of.get(c)
        if runs and runs[-1][0] == g:
            runs[-1] = (g, runs[-1][1], i)
        else:
            runs.append((g, i, i))
    grouped = len({g for g, _, _ in runs if g is not None}) >= 2  # e.g. GLUE8 and Math-10K side by side
    out = ["% generated by `prismdp experiment`; needs \\usepackage{booktabs,multirow}",
           "\\begin{table*}[t]",
           f"  \\caption{{\\textbf{{{_tex_escape(t.title)}.}} {_tex_escape(_caption(t))}}}",
           "  \\begin{center}", "    \\begin{small}", "      \\begin{sc}",
           "        \\setlength{\\tabcolsep}{2.0pt}",
           f"        \\begin{{tabular}}{{@{{}}ll*{{{n + 1}}}{{c}}@{{}}}}", "          \\toprule"]
    heads = [f"\\textbf{{{_tex_escape(COLUMN_LABELS.get(c, c))}}}" for c in t.columns]
    if grouped:
        top, rules = ["\\textbf{Setting}", "\\textbf{Method}"], []
        for g, a, b in runs:
            if g is None:
                top.extend([""] * (b - a + 1))
            else:
                top.append(f"\\multicolumn{{{b - a + 1}}}{{c}}{{\\textbf{{{_tex_escape(g)}}}}}")
                rules.append(f"\\cmidrule(lr){{{a + 3}-{b + 3}}}")
        top.append("\\textbf{Avg}")
        out.append("          " + " & ".join(top) + " \\\\")
        out.append("          " + "".join(rules))
        out.append("          & & " + " & ".join(heads) + " & \\\\")
    else:
        out.append("          \\textbf{Setting} & \\textbf{Method} & " + " & ".join(heads) + " & \\textbf{Avg} \\\\")

    def cell(s: Optional[Stat], bold: bool, dagger: str = "") -> str:
        text = _fmt(s, "$\\pm$") + dagger
        text = text.replace("–", "--").replace("†", "$^\\dagger$")
        return f"\\textbf{{{text}}}" if bold and s is not None else text

    for setting, rows in t.blocks:
        out.append("          \\midrule")
        for i, r in enumerate(rows):
            head = f"\\multirow{{{len(rows)}}}{{*}}{{{setting.tex}}}" if i == 0 else ""
            vals = [cell(r.cells.get(c), c in r.bold) for c in t.columns]
            vals.append(cell(r.avg, "__avg__" in r.bold, "†" if r.incomplete else ""))
            out.append(f"          {head} & {_tex_escape(r.label)} & " + " & ".join(vals) + " \\\\")
    out += ["          \\bottomrule", "        \\end{tabular}", "      \\end{sc}", "    \\end{small}",
            "  \\end{center}", "\\end{table*}"]
    notes = _notes(t)
    if notes:
        out += [""] + [f"% {n}" for n in notes]
    return "\n".join(out) + "\n"


def render_runtime(exp: Experiment, cells: Sequence[Cell], results: Sequence[CellResult]) -> str:
    """The paper's Table 5 layout: per task, setting and method, the step time after warm-up and the peak memory of
    the training steps (mean over the seeds that have them)."""
    by_cell = {r.cell.id: r for r in results}
    lines = ["", "## Runtime and memory", "",
             f"Mean step time after {WARMUP_STEPS} warm-up steps (all steps for runs shorter than "
             f"{2 * WARMUP_STEPS}) and peak memory of the training steps (summary.json `train`: CUDA "
             "max_memory_allocated on a GPU, the process's peak RSS on the CPU), mean over seeds.", "",
             "| Task | Setting | Method | Step time (s) | Peak memory (MB) | Runs |", "|---|---|---|---:|---:|---:|"]
    any_row = False
    for task_id in exp.tasks:
        for setting in exp.settings:
            for method in exp.methods:
                rs = [by_cell[c.id] for c in cells if c.task_id == task_id and c.setting == setting
                      and c.method == method and c.id in by_cell]
                times = [r.mean_step_time_s for r in rs if r.mean_step_time_s is not None]
                mems = [r.peak_memory_mb for r in rs if r.peak_memory_mb is not None]
                if not times and not mems:
                    continue
                any_row = True
                t = f"{statistics.fmean(times):.3f}" if times else "–"
                m = f"{statistics.fmean(mems):.0f}" if mems else "–"
                lines.append(f"| {task_id} | {setting.label} | {exp.label(method)} | {t} | {m} | {len(rs)} |")
    return "\n".join(lines) + "\n" if any_row else ""


def render_tuning(exp: Experiment, plan) -> str:
    """Per task, setting and method: the tuning score (``tune.by``) of every rate tried, and the rate chosen."""
    lrs = sorted({lr for g in plan.groups.values() for lr in g.tried})
    if not lrs:
        return ""
    lines = ["", "## Learning rates", "",
             f"Score on `{plan.tune.by}` (held out of the training data) of the tuning seed ({plan.tune_seed}) at each "
             "rate tried; **bold** = chosen (best; ties go to the smaller rate; the grid is widened when an edge "
             "wins). The tables above report every seed at the chosen rate.", "",
             "| Task | Setting | Method | " + " | ".join(f"{lr:g}" for lr in lrs) + " | chosen |",
             "|---|---|---|" + "---:|" * (len(lrs) + 1)]
    for (task_id, method, skey), g in plan.groups.items():
        label = next(st.label for st in exp.settings if st.key == skey)
        vals = []
        for lr in lrs:
            v = g.tried.get(lr)
            text = "" if lr not in g.tried else "…" if v is None else "fail" if v == -math.inf else f"{v:.4f}"
            vals.append(f"**{text}**" if lr == g.chosen else text)
        chosen = f"{g.chosen:g}" if g.chosen is not None else "…"
        lines.append(f"| {task_id} | {label} | {exp.label(method)} | " + " | ".join(vals) + f" | {chosen} |")
    return "\n".join(lines) + "\n"


def paired_differences(exp: Experiment, cells: Sequence[Cell], results: Sequence[CellResult]) -> List[Pair]:
    """``exp.compare`` (PRISM) against every other method, per task column and setting, paired by seed (the same data
    order and held-out splits).  Empty without ``exp.compare``."""
    if exp.compare is None:
        return []
    by_cell = {r.cell.id: r for r in results}
    scores: Dict[Tuple[str, str, str], Dict[int, Dict[str, float]]] = {}
    for c in cells:
        if c.id in by_cell:
            scores.setdefault((c.task_id, c.setting.key, c.method), {})[c.seed] = by_cell[c.id].scores
    pairs = []
    for task_id in exp.tasks:
        for st in exp.settings:
            ours = scores.get((task_id, st.key, exp.compare), {})
            for method in exp.methods:
                if method == exp.compare:
                    continue
                theirs = scores.get((task_id, st.key, method), {})
                for col in sorted({k for s in ours.values() for k in s}):
                    seeds = sorted(s for s in ours if s in theirs and col in ours[s] and col in theirs[s])
                    if not seeds:
                        continue
                    name = task_id if col == exp.tasks[task_id].get("task", task_id) or col == task_id else \
                        f"{task_id}:{col}"
                    pairs.append(Pair(name, st, method, seeds, [ours[s][col] - theirs[s][col] for s in seeds]))
    return pairs


def render_paired(exp: Experiment, pairs: Sequence[Pair]) -> str:
    """The paired comparisons as a table: mean difference, its sample standard deviation, seeds won, per seed."""
    if not pairs:
        return ""
    lines = ["", f"## Paired comparison: {exp.label(exp.compare)} minus each method", "",
             "Per task and setting, the difference of the reported score on the same seed (the same data order and "
             "held-out splits), mean ± sample std over the seeds both have; wins = seeds where "
             f"{exp.label(exp.compare)} scores higher.", "",
             "| Task | Setting | vs | Δ mean ± std | wins | per seed |", "|---|---|---|---:|---:|---|"]
    for p in pairs:
        wins = sum(x > 0 for x in p.diffs)
        lines.append(f"| {p.name} | {p.setting.label} | {exp.label(p.method)} | {_fmt(_stat(p.diffs), ' ± ')} | "
                     f"{wins}/{len(p.diffs)} | " + ", ".join(f"{x:+.3f}" for x in p.diffs) + " |")
    return "\n".join(lines) + "\n"


def render_pooled(exp: Experiment, pairs: Sequence[Pair]) -> str:
    """The paired differences of each method pooled over tasks: once over every private setting, once without
    privacy; with the exact two-sided sign test of "neither method is better" (ties dropped).  Only methods compared
    on more than one (task, setting) are listed.  The test takes the pooled pairs as independent (different tasks,
    settings or seeds); its p-value is not corrected for the several methods compared."""
    from scipy.stats import binomtest

    if not pairs:
        return ""
    groups: Dict[Tuple[str, bool], List[Pair]] = {}
    for p in pairs:
        groups.setdefault((p.method, p.setting.dp), []).append(p)
    ours = exp.label(exp.compare)
    lines = ["", f"## Pooled over tasks: {ours} minus each method", "",
             "Every paired seed of the table above, pooled per method over the task columns and the private settings "
             f"(and apart, without privacy); wins/losses = seeds where {ours} scores higher/lower; sign test = exact "
             "two-sided binomial test of wins against losses at 1/2 (ties dropped).", "",
             "| vs | settings | pairs | wins | losses | Δ mean | sign test p |", "|---|---|---:|---:|---:|---:|---:|"]
    rows = 0
    for method in exp.methods:
        for dp in (True, False):
            ps = groups.get((method, dp), [])
            if len(ps) < 2:
                continue
            diffs = [x for p in ps for x in p.diffs]
            wins, losses = sum(x > 0 for x in diffs), sum(x < 0 for x in diffs)
            pval = binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else float("nan")
            where = " + ".join(dict.fromkeys(p.setting.label for p in ps))
            lines.append(f"| {exp.label(method)} | {where} | {len(diffs)} | {wins} | {losses} | "
                         f"{statistics.fmean(diffs):+.3f} | {pval:.3f} |")
            rows += 1
    return "\n".join(lines) + "\n" if rows else ""


def step_multiple(exp: Experiment, name: str) -> int:
    """A pair's step budget as a multiple of the smallest budget its task is trained at in the grid (``sst2`` at
    80 steps and ``sst2-x4`` at 320: 1 and 4); 1 where the grid does not set the steps."""
    tid = name.split(":")[0]
    task = exp.tasks[tid].get("task", tid)
    steps = exp.tasks[tid].get("steps")
    same = [t.get("steps") for i, t in exp.tasks.items() if t.get("task", i) == task and t.get("steps")]
    return max(1, round(steps / min(same))) if steps and same else 1


def render_pooled_by(exp: Experiment, pairs: Sequence[Pair]) -> str:
    """The private paired differences of each method pooled over tasks, once per privacy level and once per step
    budget (as a multiple of each task's smallest), with the exact two-sided sign test (ties dropped); only where the
    grid has two or more levels or budgets.  The same caveats as the pooled table (pairs taken as independent, no
    correction for the several groups)."""
    from scipy.stats import binomtest

    private = [p for p in pairs if p.setting.dp]
    levels = list(dict.fromkeys(p.setting.label for p in private))
    budgets = sorted({step_multiple(exp, p.name) for p in private})
    if len(levels) < 2 and len(budgets) < 2:
        return ""
    ours = exp.label(exp.compare)
    lines = ["", f"## Pooled by privacy level and by step budget: {ours} minus each method", "",
             "The private pairs of the paired table, pooled over tasks within each privacy level and within each step "
             "budget (a multiple of the task's smallest budget in the grid); sign test as above.", "",
             "| vs | group | tasks | pairs | wins | losses | Δ mean | sign test p |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    groups = [(label, lambda p, label=label: p.setting.label == label) for label in levels if len(levels) > 1]
    groups += [(f"{b}x steps ({' + '.join(levels)})", lambda p, b=b: step_multiple(exp, p.name) == b)
               for b in budgets if len(budgets) > 1]
    for method in exp.methods:
        for label, keep in groups:
            ps = [p for p in private if p.method == method and keep(p)]
            diffs = [x for p in ps for x in p.diffs]
            if not diffs:
                continue
            wins, losses = sum(x > 0 for x in diffs), sum(x < 0 for x in diffs)
            pval = binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else float("nan")
            tasks = ", ".join(dict.fromkeys(p.name for p in ps))
            lines.append(f"| {exp.label(method)} | {label} | {tasks} | {len(diffs)} | {wins} | {losses} | "
                         f"{statistics.fmean(diffs):+.3f} | {pval:.3f} |")
    return "\n".join(lines) + "\n"


def render_privacy_cost(t: Table) -> str:
    """What privacy costs each method: its non-DP mean minus its mean at each privacy level, per task column (the
    means of the main table).  Not paired by seed: each setting has its own tuned rate and, for DP, its own noise."""
    nondp = next((rows for st, rows in t.blocks if not st.dp), None)
    private = [(st, {r.method: r for r in rows}) for st, rows in t.blocks if st.dp]
    if not nondp or not private:
        return ""
    head = " | ".join(f"{st.label} | cost" for st, _ in private)
    lines = ["", "## Cost of privacy: non-DP minus private, per method", "",
             "Per task column, each method's mean score without privacy and at each privacy level, and the cost = "
             "non-DP minus private (positive = privacy loses that much).", "",
             f"| Task | Method | Non-DP | {head} |", "|---|---|---:|" + "---:|---:|" * len(private)]
    for col in t.columns:
        for r in nondp:
            base = r.cells.get(col)
            theirs = [by[r.method].cells.get(col) if r.method in by else None for _, by in private]
            if base is None or all(s is None for s in theirs):
                continue
            entries = " | ".join("– | –" if s is None else f"{s.mean:.3f} | {base.mean - s.mean:.3f}"
                                 for s in theirs)
            lines.append(f"| {COLUMN_LABELS.get(col, col)} | {r.label} | {base.mean:.3f} | {entries} |")
    return "\n".join(lines) + "\n"


def write_results(exp: Experiment, cells: Sequence[Cell], out_dir: Path,
                  failures: Optional[Dict[str, str]] = None, plan=None, archive=None) -> Tuple[List[CellResult], Table]:
    """Read every finished cell and write ``results.csv``, ``results.md`` and ``results.tex`` into ``out_dir``, and
    with matplotlib installed the paired comparisons as ``paired.png`` (:mod:`prismdp.experiment.figure`) and, for
    tasks trained at several step budgets, the budget curves as ``budget.png`` (:mod:`prismdp.experiment.budget`).

    With a tuning ``plan`` (:mod:`prismdp.experiment.tuning`), ``cells`` are the reported runs (every seed at each
    group's chosen rate), results.csv also holds every tuning run, and results.md gains the learning-rate table.
    Cells without a run folder are read from ``archive`` (an earlier results.csv) where it has them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = [r for r in (read_cell(c, archive) for c in cells) if r is not None]
    listed = plan.all_cells() if plan is not None else cells
    every = results if plan is None else [r for r in (read_cell(c, archive) for c in listed) if r is not None]
    write_csv(out_dir / "results.csv", result_rows(exp, every))
    table = build_table(exp, cells, results, failures)
    pairs = paired_differences(exp, cells, results)
    md = render_markdown(table) + render_paired(exp, pairs) + render_pooled(exp, pairs)
    md += render_pooled_by(exp, pairs)
    md += render_privacy_cost(table)
    md += render_parts(exp, cells, results)
    budget = budget_points(exp, cells, results)
    md += render_budget(exp, budget)
    if plan is not None:
        md += render_tuning(exp, plan)
    write_text(out_dir / "results.md", md + render_runtime(exp, cells, results))
    write_text(out_dir / "results.tex", render_latex(table))
    if pairs and have_matplotlib():
        save_paired_figure(exp, pairs, out_dir / "paired.png")
    if budget and have_matplotlib():
        save_budget_figure(exp, budget, out_dir / "budget.png")
    return results, table
