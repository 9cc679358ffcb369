"""Which optimisation moved which number: PRISM's mechanism time per step with each optimisation switched off.

The mechanism alone (``accumulate`` per micro-batch + ``step``), on the LoRA layout of W2 (SmolLM2-135M shapes:
30 layers x q/k/v/up/down, r 16, 150 modules in 4 shape groups; random-init weights, no model load) with
synthetic per-example gradients, batch 8 as 2 micro-batches of 4.  Variants, interleaved, medians:

* ``current``        what ships.
* ``per-module``     no batching by shape (every module its own group: the pre-optimisation loop).
* ``qr-norms``       per-example norms by triangular solves (:func:`prismdp.geometry.projected_grad_norm_sq`)
                     instead of the Gram form (:func:`~prismdp.geometry.projected_grad_norm_sq_balanced`).
* ``always-mask``    the non-finite masking pass over every per-example gradient even when all are finite.
* ``all-off``        the three together.
* ``dp-adamw``       prismdp's factor-space DP-AdamW mechanism on the same gradients, for reference.

Run: ``python -m bench.ablation [--threads 2] [--steps 10]``; writes ``bench/results/ablation.json`` and ``.md``.
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
    from peft import LoraConfig, get_peft_model

    from prismdp.engine import make_private
    from prismdp.grad_sample import PerExampleGrads

    off = {"per-module", "qr-norms", "always-mask"} if variant == "all-off" else {variant}
    kwargs = {} if variant == "dp-adamw" else {"stack_by_shape": "per-module" not in off,
                                                 "norms": "qr" if "qr-norms" in off else "gram"}
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]))
    private = make_private(model, method="dp-adamw" if variant == "dp-adamw" else "prism", lr=1e-4,
                           dataset_size=80, batch_size=8, steps=10 ** 6, noise_multiplier=1.0, seed=0, **kwargs)
    private.mechanism.budget = None
    private.mechanism.always_mask = "always-mask" in off
    g = torch.Generator().manual_seed(0)
    lora = [(torch.randn(4, p.shape[0], 16, generator=g), torch.randn(4, p.shape[1], 16, generator=g))
            for p in private.pairs]
    # the sampler's stacked layout, as in training
    stacked = [(torch.stack([lora[k][0] for k in idx]), torch.stack([lora[k][1] for k in idx]))
               for idx in private.grad_sampler.stacks]
    views = [None] * len(lora)
    for idx, (gb, ga) in zip(private.grad_sampler.stacks, stacked):
        for j, k in enumerate(idx):
            views[k] = (gb[j], ga[j])
    grads = PerExampleGrads(4, views, stacks=private.grad_sampler.stacks, stacked=stacked)
    opt = private.optimizer

    def step():
        opt.accumulate(grads)
        opt.accumulate(grads)
        opt.step()

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--output", default=str(Path(__file__).resolve().parent / "results"))
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
    lines = ["# PRISM mechanism ablation (W2 layout: 150 LoRA modules, 4 shape groups, batch 8 as 2 x 4)", "",
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
