"""Issue 45: how much of one clipped per-example gradient the new classification head takes, at the start of a run.

    python scripts/head-share.py CONFIG TASK [--examples 64] [--clip 1.0]

Builds the model of one cell of an experiment grid exactly as the grid does (``prismdp.train.build_run``: the
checkpoint, the head, LoRA on the config's targets; DP-AdamW without privacy, seed 42), then, for the first
``--examples`` training examples one at a time, the gradient of the example's loss, split into the LoRA factors and
the trainable dense parameters (the new head). DP-SGD clips the whole per-example gradient to norm C: where the head's
norm is far above the LoRA factors', the head takes nearly all of C and the LoRA factors' share of the clipped signal
is their norm over the total. Printed: per-example norms (median, mean), the head's share of the squared norm and
the LoRA factors' norm after clipping, mean over examples. The head's gradient is the same for every method at the
start (every method starts from the same function); the LoRA part is DP-AdamW's factor gradient at PEFT's start
(B = 0, so only B has one). PRISM starts at a rank-r point and clips its tangent-space gradient, which this does not
measure. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics

from prismdp.data.collate import pad_collate
from prismdp.experiment.grid import load_experiment, parse_setting
from prismdp.lora.pairs import find_lora_pairs
from prismdp.train.build import build_run
from prismdp.train.step import model_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("task")
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--clip", type=float, default=1.0)
    args = ap.parse_args()
    exp = load_experiment(args.config)
    cells = exp.cells(tasks=[args.task], methods=["dp-adamw"], settings=[parse_setting("non-dp")], seeds=[42])
    run = build_run(cells[0].config, log=lambda *_: None)
    model, data = run.model, run.data
    factors = {id(p) for pair in find_lora_pairs(model) for p in pair.params}
    params = [("lora" if id(p) in factors else "head", p) for p in model.parameters() if p.requires_grad]
    pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    head, lora, share2, clipped = [], [], [], []
    for feature in data.train[: args.examples]:
        batch = pad_collate([feature], pad)
        labels = batch.pop("labels")
        model.zero_grad(set_to_none=True)
        logits = model(**model_inputs(batch, run.device)).logits
        data.loss(logits, labels.to(run.device)).sum().backward()
        sq = {"lora": 0.0, "head": 0.0}
        for kind, p in params:
            if p.grad is not None:
                sq[kind] += float(p.grad.double().pow(2).sum())
        h, l = sq["head"] ** 0.5, sq["lora"] ** 0.5
        total = (h * h + l * l) ** 0.5
        head.append(h)
        lora.append(l)
        share2.append(h * h / (total * total))
        clipped.append(l * min(1.0, args.clip / total))  # the LoRA factors' norm after clipping the whole to C
    count = {k: sum(p.numel() for kind, p in params if kind == k) for k in ("lora", "head")}
    print(f"{args.config} {args.task}: {len(head)} training examples; trainable: LoRA {count['lora']:,}, "
          f"head/dense {count['head']:,}")
    print(f"  per-example gradient norm, head:  median {statistics.median(head):.3g}, mean {statistics.mean(head):.3g}")
    print(f"  per-example gradient norm, LoRA:  median {statistics.median(lora):.3g}, mean {statistics.mean(lora):.3g}")
    print(f"  head's share of the squared norm: mean {statistics.mean(share2):.4f}")
    print(f"  LoRA's norm after clipping to C={args.clip:g}: mean {statistics.mean(clipped):.3g}")


if __name__ == "__main__":
    main()
