"""Which optimisation moved which number: PRISM's mechanism time per step with each optimisation switched off.

The mechanism alone (``accumulate`` per micro-batch + ``step``), on the LoRA layout of W2 (SmolLM2-135M shapes:
30 layers x q/k/v/up/down, r 16, 150 modules in 4 shape stacks; random-init weights, no model load) with
synthetic per-example gradients, batch 8 as 2 micro-batches of 4.  Variants, interleaved, medians:

* ``current``        what ships.
* ``per-module``     no batching by shape (every module its own stack: the pre-optimisation loop).
* ``qr-norms``       per-example norms by triangular solves (:func:`prismdp.geometry.projected_grad_norm_sq`)
                     instead of the Gram form (:func:`~prismdp.geometry.projected_grad_norm_sq_balanced`).
* ``always-mask``    the non-finite masking pass over every per-example gradient even when all are finite.
* ``all-off``        the three together.
* ``dp-adamw``       prismdp's factor-space DP-AdamW mechanism on the same gradients, for reference.

Run: ``python -m bench.studies.ablation [--threads 2] [--steps 10]``; writes ``bench/results/ablation.json`` and
``.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

VARIANTS = ("current", "per-module", "qr-norms", "always-mask", "all-off", "dp-adamw")


def _setup(base, variant):
    from prismdp.grad_sample import PerExampleGrads
    from prismdp.lora import find_lora_pairs, move_to_rank_r_start, stack_by_shape
    from prismdp.optim import PRISM, dp_adamw
    from prismdp.privacy.clipping import DPConfig
    from prismdp.privacy.mechanism import GaussianMechanism
    from prismdp.train.build import build_lora_model
    from prismdp.train.config import TrainConfig

    off = {"per-module", "qr-norms", "always-mask"} if variant == "all-off" else {variant}
    lora_cfg = TrainConfig(rank=16, alpha=16, dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"])
    model = build_lora_model(lora_cfg, copy.deepcopy(base))[0]
    pairs = find_lora_pairs(model)
    # the mechanism alone (sigma 1, C 1, expected batch 8; no budget): each switch is a constructor option
    mechanism = GaussianMechanism(DPConfig(1.0, 1.0, 8.0), generator=torch.Generator().manual_seed(0),
                                  always_mask="always-mask" in off)
    if variant == "dp-adamw":
        opt = dp_adamw(pairs, lr=1e-4, mechanism=mechanism)
    else:
        move_to_rank_r_start(pairs, generator=torch.Generator().manual_seed(2))
        opt = PRISM(pairs, lr=1e-4, mechanism=mechanism, stack_by_shape="per-module" not in off,
                    norms="qr" if "qr-norms" in off else "gram")
    g = torch.Generator().manual_seed(0)
    lora = [(torch.randn(4, 16, p.shape[0], generator=g), torch.randn(4, 16, p.shape[1], generator=g))
            for p in pairs]
    # the gradient sampler's stacked rank-major layout, as in training
    stacks = stack_by_shape(pairs)
    stacked = [(torch.stack([lora[k][0] for k in idx]), torch.stack([lora[k][1] for k in idx])) for idx in stacks]
    views = [None] * len(lora)
    for idx, (gb, ga) in zip(stacks, stacked):
        for j, k in enumerate(idx):
            views[k] = (gb[j].mT, ga[j].mT)
    grads = PerExampleGrads(4, views, stacks=stacks, stacked=stacked)

    def step():
        opt.accumulate(grads)
        opt.accumulate(grads)
        opt.step()

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--output", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=576, intermediate_size=1536,
                                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3))
    steps = {v: _setup(base, v) for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for rnd in range(args.warmup + args.steps):
        for v, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            if rnd >= args.warmup:
                times[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    report = {"threads": args.threads, "steps": args.steps, "median_s": med, "times_s": times,
              "relative_to_current": {v: med[v] / med["current"] for v in VARIANTS}}
    lines = ["# PRISM mechanism ablation (W2 layout: 150 LoRA modules, 4 shape stacks, batch 8 as 2 x 4)", "",
             f"{args.threads} thread(s), {args.warmup} warm-up + {args.steps} measured rounds, interleaved.", "",
             "| variant | mechanism per step (ms) | / current |", "|---|---:|---:|"]
    lines += [f"| {v} | {1e3 * med[v]:.1f} | {med[v] / med['current']:.2f} |" for v in VARIANTS]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
