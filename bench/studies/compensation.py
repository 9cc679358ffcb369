"""Per-layer micro-benchmark of the rank-r start's dropout compensation (issue 17): one PEFT LoRA layer, forward +
backward with the gradient sampler's taps armed, input requiring grad (an inner layer), one thread, CPU time.

Variants, interleaved in every round: ``comp`` (the rank-r start with LoRA dropout 0.05 and its compensation, as
PRISM runs), ``no-comp`` (the same after ``start.dropout_compensation.remove()``: dropout also hits ``Z0 x``, not
exact) and ``plain`` (PEFT's start, no rank-r start: what dp-adamw runs).  Reported: medians of per-round ratios.
It uses only the public API, so the same file times any checkout: ``PYTHONPATH=<checkout>/src python -m
bench.studies.compensation``.

    python -m bench.studies.compensation [--rounds 30] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..micro import _OneLinear  # the one-Linear model the micro-benchmarks wrap in PEFT

SHAPES = {  # name: (m, n, r, batch, length)
    "W0 384->384 r4 8x32": (384, 384, 4, 8, 32),
    "W1 384->384 r16 4x128": (384, 384, 16, 4, 128),
    "W2 up_proj 576->1536 r16 4x128": (1536, 576, 16, 4, 128),
}
VARIANTS = ("comp", "no-comp", "plain")


def _layer(variant: str, m: int, n: int, r: int):
    from peft import LoraConfig, get_peft_model

    from prismdp.grad_sample import GradSampler
    from prismdp.lora import find_lora_pairs, move_to_rank_r_start

    torch.manual_seed(0)
    model = get_peft_model(_OneLinear(m, n), LoraConfig(r=r, lora_alpha=r, lora_dropout=0.05, target_modules=["proj"]))
    model.train()
    pairs = find_lora_pairs(model)
    sampler = GradSampler(model, pairs)
    if variant != "plain":
        start = move_to_rank_r_start(pairs, generator=torch.Generator().manual_seed(0))
        if variant == "no-comp":
            start.dropout_compensation.remove()
    else:
        with torch.no_grad():
            pairs[0].lora_B.weight.normal_()
    sampler.arm()
    return model, sampler


def run(rounds: int, reps: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, (m, n, r, b, T) in SHAPES.items():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(b, T, n, generator=g).requires_grad_(True)
        dy = torch.randn(b, T, m, generator=g)
        layers = {v: _layer(v, m, n, r) for v in VARIANTS}

        def once(v):
            model, sampler = layers[v]
            t0 = time.process_time()
            for _ in range(reps):
                (model(x) * dy).sum().backward()
                sampler.collect()
                model.zero_grad(set_to_none=True)
                x.grad = None
            return (time.process_time() - t0) / reps

        for v in VARIANTS:  # warm-up
            once(v)
        times = {v: [] for v in VARIANTS}
        for k in range(rounds):
            for v in (VARIANTS if k % 2 == 0 else VARIANTS[::-1]):
                times[v].append(once(v))
        ratio = lambda a, c: statistics.median(x / y for x, y in zip(times[a], times[c]))
        out[name] = {"median_us": {v: 1e6 * statistics.median(t) for v, t in times.items()},
                     "comp/plain": ratio("comp", "plain"), "comp/no-comp": ratio("comp", "no-comp"),
                     "no-comp/plain": ratio("no-comp", "plain")}
        print(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else {a: round(c, 1) for a, c in v.items()})
                                for k, v in out[name].items()}), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    a = p.parse_args()
    res = run(a.rounds, a.reps)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"torch": torch.__version__, "rounds": a.rounds, "reps": a.reps, "shapes": res}, f, indent=1)


if __name__ == "__main__":
    main()
