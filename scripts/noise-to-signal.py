"""Issue 45: how much signal a private run's budget leaves, per run folder and for other batch sizes.

    python scripts/noise-to-signal.py RUN_FOLDER [RUN_FOLDER ...] [--batches 64,256,1024] [--steps 40,80]
                                      [--coordinates 231552]

For each finished run folder (its privacy.json, config.json and adapter/), with D the number of trained
coordinates: the released sum of one step is a clipped sum of about B per-example gradients, each of norm at most C,
plus Gaussian noise of norm about sigma C sqrt(D). So B / (sigma sqrt(D)) bounds the ratio of signal to noise in one
step (reached only if every example's clipped gradient points the same way), and over T steps, where the signal adds
up and the noise adds in quadrature, B sqrt(T) / (sigma sqrt(D)). A heuristic, not a bound on accuracy: it compares
budgets of runs whose models differ in size. PRISM's noise lies in the tangent space, of dimension (m + n) r - r^2
per LoRA pair, within about 2 % of the LoRA coordinates counted here at r 16 (r / (m + n)). With --batches, the same
ratios for other expected batches at the folder's epsilon, delta, dataset size and accountant (sigma calibrated by
prismdp's accountant), for the folder's D or, with --coordinates, for other adapters' D.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from safetensors import safe_open

from prismdp.privacy.accounting import calibrate_sigma


def coordinates(folder: Path) -> int:
    """Trained coordinates of a finished run: every tensor of its exported adapter, a LoRA factor counted at the
    run's own rank (config.json's ``rank``).  A PRISM adapter is exported at rank 2r, its trained factors beside the
    fixed start it moved away from (prismdp.export), so its tensors hold twice the trained LoRA coordinates."""
    rank = json.loads((folder / "config.json").read_text())["rank"]
    (adapter,) = (folder / "adapter").glob("*.safetensors")
    d = 0
    with safe_open(str(adapter), "pt") as f:
        for k in f.keys():
            shape = f.get_slice(k).get_shape()
            if k.endswith("lora_A.weight"):  # (r, n), or (2r, n) exported with the start
                shape = [rank, shape[1]]
            elif k.endswith("lora_B.weight"):  # (m, r) or (m, 2r)
                shape = [shape[0], rank]
            d += math.prod(shape)
    return d


def row(name: str, d: int, b: float, t: int, sigma: float) -> str:
    step = b / (sigma * math.sqrt(d))
    return f"| {name} | {d:,} | {b:g} | {t} | {sigma:.4f} | {step:.3f} | {step * math.sqrt(t):.2f} | {b * t:,.0f} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--batches", default="", help="comma-separated expected batch sizes to calibrate for")
    p.add_argument("--steps", default="", help="comma-separated step counts (default: the folder's)")
    p.add_argument("--coordinates", default="", help="comma-separated D for the calibrated rows (default: the "
                   "folder's), e.g. a smaller adapter's trained coordinates counted from the model's shapes")
    args = p.parse_args()
    print("| run | D | B | T | sigma | B / (sigma sqrt D) | x sqrt T | examples seen |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for folder in args.folders:
        priv = json.loads((folder / "privacy.json").read_text())
        d, n = coordinates(folder), priv["dataset_size"]
        print(row(folder.name, d, priv["expected_batch_size"], priv["steps"], priv["noise_multiplier"]))
        steps = [int(s) for s in args.steps.split(",") if s] or [priv["steps"]]
        dims = [int(x) for x in args.coordinates.split(",") if x] or [d]
        for b in (float(x) for x in args.batches.split(",") if x):
            for t in steps:
                sigma = calibrate_sigma(priv["target_epsilon"], priv["delta"], b / n, t, priv["accountant"])
                for dim in dims:
                    print(row(f"(same epsilon {priv['target_epsilon']:g})", dim, b, t, sigma))


if __name__ == "__main__":
    main()
