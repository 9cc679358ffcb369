"""Issue 45: how much of one clipped per-example gradient the new classification head takes, at the start of a run.

    python scripts/head-share.py CONFIG TASK [--method dp-adamw|prism] [--examples 64] [--clip 1.0]

Builds the model of one cell of an experiment grid exactly as the grid does (``prismdp.train.build_run``: the
checkpoint, the head, LoRA on the config's targets; the method's cell without privacy, seed 42), then, for the first
``--examples`` training examples one at a time, the gradient of the example's loss, split into the LoRA factors and
the trainable dense parameters (the new head). DP-SGD clips the whole per-example gradient to norm C: where the head's
norm is far above the LoRA factors', the head takes nearly all of C and the LoRA factors' share of the clipped signal
is their norm over the total. Printed: per-example norms (median, mean), the head's share of the squared norm and
the LoRA part's norm after clipping, mean over examples. The head's gradient is the same for every method at the
start (every method starts from the same function). The LoRA part is what the method clips:

* ``dp-adamw``: the Euclidean gradient of the PEFT factors at PEFT's start (B = 0, so only B has one);
* ``prism``: the norm of the projection ``P(G)`` of the gradient ``G`` of ``Z = A B^T`` onto the tangent space of the
  rank-r manifold at PRISM's start (the cell's own rank-r point, built by the engine), per module, summed in squares
  over modules, from the factor gradients ``gA = G B``, ``gB = G^T A`` by ``prismdp.geometry.projected_grad_norm_sq``
  in float64 (``||G Q_B||^2 + ||G^T Q_A||^2 - ||Q_A^T G Q_B||^2``, tested against a dense projection), not through
  the engine's per-example clipping path.

A measurement, not a test.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from prismdp import geometry
from prismdp.data.collate import pad_collate
from prismdp.experiment.grid import load_experiment, parse_setting
from prismdp.lora.pairs import find_lora_pairs, get_factors
from prismdp.train.build import build_run
from prismdp.train.step import model_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("task")
    ap.add_argument("--method", choices=["dp-adamw", "prism"], default="dp-adamw")
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--clip", type=float, default=1.0)
    args = ap.parse_args()
    exp = load_experiment(args.config)
    cells = exp.cells(tasks=[args.task], methods=[args.method], settings=[parse_setting("non-dp")], seeds=[42])
    run = build_run(cells[0].config, log=lambda *_: None)
    model, data = run.model, run.data
    pairs = find_lora_pairs(model)
    factors = {id(p) for pair in pairs for p in pair.params}
    head_params = [p for p in model.parameters() if p.requires_grad and id(p) not in factors]
    frames = [geometry.frame(*get_factors(pair, torch.float64)) for pair in pairs] if args.method == "prism" else None
    pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    head, lora, share2, clipped = [], [], [], []
    for feature in data.train[: args.examples]:
        batch = pad_collate([feature], pad)
        labels = batch.pop("labels")
        model.zero_grad(set_to_none=True)
        logits = model(**model_inputs(batch, run.device)).logits
        data.loss(logits, labels.to(run.device)).sum().backward()
        h = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in head_params if p.grad is not None))
        l = math.sqrt(_lora_sq(pairs, frames))
        total = (h * h + l * l) ** 0.5
        head.append(h)
        lora.append(l)
        share2.append(h * h / (total * total))
        clipped.append(l * min(1.0, args.clip / total))  # the LoRA part's norm after clipping the whole to C
    lora_count = sum(p.numel() for pair in pairs for p in pair.params)
    what = "tangent-space P(G) at PRISM's rank-r start" if frames else "PEFT factors at PEFT's start"
    print(f"{args.config} {args.task} {args.method}: {len(head)} training examples; trainable: LoRA {lora_count:,}, "
          f"head/dense {sum(p.numel() for p in head_params):,}; LoRA part: {what}")
    print(f"  per-example gradient norm, head:  median {statistics.median(head):.3g}, mean {statistics.mean(head):.3g}")
    print(f"  per-example gradient norm, LoRA:  median {statistics.median(lora):.3g}, mean {statistics.mean(lora):.3g}")
    print(f"  head's share of the squared norm: mean {statistics.mean(share2):.4f}")
    print(f"  LoRA's norm after clipping to C={args.clip:g}: mean {statistics.mean(clipped):.3g}")


def _lora_sq(pairs, frames) -> float:
    """The LoRA part's squared norm for this example: PEFT's factor gradients (``frames`` None) or, per module,
    ``||P(G)||_F^2`` from ``gA = G B = dL/dW_B / sqrt(s)`` and ``gB = G^T A = (dL/dW_A)^T / sqrt(s)``."""
    total = 0.0
    for i, pair in enumerate(pairs):
        wa, wb = pair.params
        if frames is None:
            total += sum(float(p.grad.double().pow(2).sum()) for p in (wa, wb) if p.grad is not None)
            continue
        root = math.sqrt(pair.scaling)
        gA, gB = wb.grad.double() / root, wa.grad.double().T / root
        total += float(geometry.projected_grad_norm_sq(frames[i], gA, gB))
    return total


if __name__ == "__main__":
    main()
