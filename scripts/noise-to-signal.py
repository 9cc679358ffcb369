"""Issue 45: how much signal a private run's budget leaves, per run folder and for other batch sizes.

    python scripts/noise-to-signal.py RUN_FOLDER [RUN_FOLDER ...] [--batches 64,256,1024] [--steps 40,80]

For each finished run folder (its privacy.json and adapter/), with D the number of trained coordinates: the released
sum of one step is a clipped sum of about B per-example gradients, each of norm at most C, plus Gaussian noise of
norm about sigma C sqrt(D). So B / (sigma sqrt(D)) bounds the ratio of signal to noise in one step (reached only
if every example's clipped gradient points the same way), and over T steps, where the signal adds up and the noise
adds in quadrature, B sqrt(T) / (sigma sqrt(D)). A heuristic, not a bound on accuracy: it compares budgets of runs
whose models differ in size. PRISM's noise lies in the tangent space, of dimension (m + n) r - r^2 per LoRA pair,
within 1 % of the LoRA coordinates counted here at r 16. With --batches, the same ratios for other expected batches
at the folder's epsilon, delta, dataset size and accountant (sigma calibrated by prismdp's accountant).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from safetensors import safe_open

from prismdp.privacy.accounting import calibrate_sigma


def coordinates(folder: Path) -> int:
    (adapter,) = (folder / "adapter").glob("*.safetensors")
    with safe_open(str(adapter), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def row(name: str, d: int, b: float, t: int, sigma: float) -> str:
    step = b / (sigma * math.sqrt(d))
    return f"| {name} | {d:,} | {b:g} | {t} | {sigma:.4f} | {step:.3f} | {step * math.sqrt(t):.2f} | {b * t:,.0f} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--batches", default="", help="comma-separated expected batch sizes to calibrate for")
    p.add_argument("--steps", default="", help="comma-separated step counts (default: the folder's)")
    args = p.parse_args()
    print("| run | D | B | T | sigma | B / (sigma sqrt D) | x sqrt T | examples seen |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for folder in args.folders:
        priv = json.loads((folder / "privacy.json").read_text())
        d, n = coordinates(folder), priv["dataset_size"]
        print(row(folder.name, d, priv["expected_batch_size"], priv["steps"], priv["noise_multiplier"]))
        steps = [int(s) for s in args.steps.split(",") if s] or [priv["steps"]]
        for b in (float(x) for x in args.batches.split(",") if x):
            for t in steps:
                sigma = calibrate_sigma(priv["target_epsilon"], priv["delta"], b / n, t, priv["accountant"])
                print(row(f"(same epsilon {priv['target_epsilon']:g})", d, b, t, sigma))


if __name__ == "__main__":
    main()
