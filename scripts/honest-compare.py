"""Issue 45, item 2: PRISM against DP-AdamW under three ways of choosing the learning rate, paired by seed.

    python scripts/honest-compare.py HONEST.csv NOTUNE.csv FREE.csv [FREE.csv ...] > docs/results-cpu/honest/compare.md

- (a) honest: every cell a `prismdp tune`, the rate's choice paid for inside the cell's epsilon (HONEST.csv, the
  results.csv of configs/cpu-minilm-honest.yaml; may be missing or partial: its cells show as pending);
- (b) no tuning: the README's starting rates, the whole budget in one run (configs/cpu-minilm-notune.yaml);
- (c) free tuning: the benchmark's rates chosen on `val` outside the budget (FREE.csv: the benchmark's and the when
  grid's results.csv). Its chosen rate is the one seeds 43 and 44 ran at (they run only at the chosen rate); only
  the cells with the steps of (b)'s cell count.

Prints one markdown table: per task and epsilon, each arm's PRISM and DP-AdamW dev score (mean +- sample sd over
the seeds the arm has) and PRISM's paired lead (mean, seeds PRISM wins).
"""

import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

METHODS = ("prism", "dp-adamw")
SEEDS = ("42", "43", "44")
EPSILONS = (3.0, 8.0)  # configs/cpu-minilm-honest.yaml and cpu-minilm-notune.yaml


def scores(path: str) -> list[dict]:
    """The dev-score rows (metric ``score`` of the task's own column) of a results.csv; none if it is missing."""
    if not Path(path).exists():
        return []
    with open(path, newline="") as fh:
        return [r for r in csv.DictReader(fh) if r["metric"] == "score" and r["column"] == r["task"]
                and r["dp"] == "True"]


def by_cell(rows: list[dict]) -> dict:
    """(task, method, epsilon, seed) -> (score, steps)."""
    return {(r["task"], r["method"], float(r["epsilon_target"]), r["seed"]): (float(r["value"]), r["steps"])
            for r in rows}


def free_tuned(rows: list[dict], steps: dict) -> dict:
    """(c): per (task, method, epsilon) at ``steps[task]``, the seeds at the rate seed 43 ran at."""
    rows = [r for r in rows if r["steps"] == steps.get(r["task"])]
    chosen = {(r["task"], r["method"], r["epsilon_target"]): r["lr"] for r in rows if r["seed"] == "43"}
    return by_cell([r for r in rows if chosen.get((r["task"], r["method"], r["epsilon_target"])) == r["lr"]])


def cell(values: list[float], missing: str) -> str:
    if not values:
        return missing
    sd = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.3f}{sd} ({len(values)})"


def lead(arm: dict, task: str, eps: float, missing: str) -> str:
    diffs = [arm[(task, "prism", eps, s)][0] - arm[(task, "dp-adamw", eps, s)][0] for s in SEEDS
             if (task, "prism", eps, s) in arm and (task, "dp-adamw", eps, s) in arm]
    if not diffs:
        return missing
    return f"{100 * statistics.mean(diffs):+.1f} ({sum(d > 0 for d in diffs)}/{len(diffs)})"


def main(honest: str, notune: str, free: list[str]) -> None:
    b = by_cell(scores(notune))
    steps = {task: st for (task, *_), (_, st) in b.items()}
    arms = {"(a) honest": by_cell(scores(honest)), "(b) no tuning": b,
            "(c) free tuning": free_tuned([r for f in free for r in scores(f)], steps)}
    print("| task | epsilon | arm | PRISM | DP-AdamW | PRISM's lead, points (seeds won) |")
    print("|---|---:|---|---:|---:|---:|")
    for task, eps in [(t, e) for t in sorted(steps) for e in EPSILONS]:
        for name, arm in arms.items():
            col = defaultdict(list)
            for s in SEEDS:
                for m in METHODS:
                    if (task, m, eps, s) in arm:
                        col[m].append(arm[(task, m, eps, s)][0])
            missing = "not run" if name.startswith("(c)") else "pending"  # (c) is complete: what it lacks, it lacks
            print(f"| {task} ({steps[task]} steps) | {eps:g} | {name} | {cell(col['prism'], missing)} | "
                  f"{cell(col['dp-adamw'], missing)} | {lead(arm, task, eps, missing)} |")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
