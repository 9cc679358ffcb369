"""Does SmolLM2 learn a GLUE task without privacy in the decoder grid's budget?  The criterion of
configs/cpu-smollm2-glue.yaml, written down before any result: the non-private DP-AdamW check (seed 42, the rates
that ran) reaches a dev accuracy at least 5 points above the dev set's majority class at one rate.

    python scripts/decoder-grid-learns.py OUT TASK [RESULTS.csv ...]   # exit 0: learns; 1: does not; 2: not run yet

Reads OUT/<TASK>__dp-adamw__nondp__lr*__seed42/summary.json, and the rows of those cells in the given results.csv
files (a resumed grid whose run folders are gone); prints one line per rate and the verdict.
"""

import csv
import json
import sys
from pathlib import Path

MARGIN = 0.05
DEV = {"qqp": "test"}  # QQP's dev set is carved from its training set (holdout_test); the others: the official one


def main(out: str, task: str, csvs) -> int:
    dev = DEV.get(task, "validation")
    prefix = f"{task}__dp-adamw__nondp__lr"
    seen = {}  # cell id -> (dev accuracy, majority or None)
    for path in sorted(Path(out).glob(f"{prefix}*__seed42/summary.json")):
        ev = json.loads(path.read_text())["eval"][dev]
        seen[path.parent.name] = (ev["accuracy"], ev["majority_baseline"])
    for name in csvs:
        with open(name, newline="") as fh:
            for row in csv.DictReader(fh):
                if (row["cell_id"].startswith(prefix) and row["cell_id"].endswith("__seed42")
                        and row["column"] == dev and row["metric"] == "accuracy"):
                    seen.setdefault(row["cell_id"], (float(row["value"]), None))
    if not seen:
        print(f"{task}: the non-private check has not run")
        return 2
    if any(m is None for _, m in seen.values()):
        if task in DEV:
            print(f"{task}: its dev set is carved from training data: the check needs its run folders in {out}")
            return 2
        from prismdp.data import load_glue

        labels = [ex.label for ex in load_glue(task, "validation", "../shared/data/glue")]
        major = max(labels.count(k) for k in set(labels)) / len(labels)
        seen = {k: (a, major if m is None else m) for k, (a, m) in seen.items()}
    learns = False
    for cell, (acc, major) in sorted(seen.items()):
        ok = acc >= major + MARGIN
        learns |= ok
        print(f"{cell}: dev accuracy {acc:.3f}, majority class {major:.3f}, margin {100 * (acc - major):+.1f} points")
    print(f"{task}: {'learns' if learns else 'does not learn'} (criterion: +{100 * MARGIN:.0f} points at one rate)")
    return 0 if learns else 1


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
