"""Every registered method (the six built in), one short private run each on SST-2 (packaged MiniLM, epsilon 3, same
seed and steps).

Writes bench/results/sst2_methods.json and .md: dev accuracy, epsilon and median step time per method.
Run: ``python -m bench.studies.sst2_methods [--data ../shared/data/glue] [--steps 100]``.  Every method runs at the
learning rate of the built-in demo task (its registered ``lr["demo"]``: sized for ~100 private steps; the paper's GLUE
rates are for 500 steps of a 4B model) unless ``--lr METHOD=VALUE`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from prismdp.engine import METHODS
from prismdp.train.config import TrainConfig
from prismdp.train.loop import train


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[3] / "shared" / "data" / "glue"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=float, default=128)
    ap.add_argument("--train-examples", type=int, default=None, help="default: all 67,349")
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--methods", default=",".join(METHODS), help="default: every registered method")
    ap.add_argument("--lr", action="append", default=[], help="METHOD=VALUE overrides")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args(argv)
    lrs = dict(kv.split("=") for kv in args.lr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            cfg = TrainConfig(task="sst2", data=args.data, method=method, epsilon=args.epsilon, steps=args.steps,
                              batch_size=args.batch_size, micro_batch_size=16, rank=4, alpha=16,
                              target_modules=["query", "value"], max_length=64,
                              train_examples=args.train_examples, seed=args.seed, output=os.path.join(tmp, method),
                              lr=float(lrs[method]) if method in lrs else METHODS[method].lr["demo"])
            res = train(cfg, progress=False, log=lambda *a: None)
            times = [json.loads(x)["step_time_s"] for x in open(os.path.join(tmp, method, "metrics.jsonl"))]
            ev = res.summary["eval"]["validation"]
            resolved = json.load(open(os.path.join(tmp, method, "config.json")))
            rows.append({"method": method, "lr": resolved["lr"], "dev_accuracy": ev["accuracy"],
                         "majority_baseline": ev["majority_baseline"], "epsilon": res.summary["privacy"]["epsilon"],
                         "noise_multiplier": resolved["noise_multiplier"], "median_step_time_s": statistics.median(times)})
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k != "out"}
    with open(os.path.join(args.out, "sst2_methods.json"), "w") as f:
        json.dump({"settings": meta, "rows": rows}, f, indent=2)
    lines = ["| method | lr | dev accuracy | epsilon | median step time (s) |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['lr']:g} | {r['dev_accuracy']:.4f} | {r['epsilon']:.3f} | "
              f"{r['median_step_time_s']:.2f} |" for r in rows]
    lines.append(f"\nmajority-class baseline on SST-2 dev: {rows[0]['majority_baseline']:.4f}; settings: {meta}")
    Path(args.out, "sst2_methods.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
