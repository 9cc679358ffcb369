"""What PRISM's mechanism should cost at the paper's scale: its share of a training step for the W1/W2 shapes and for
Gemma-3-4B, from the mechanism micro-benchmark's measured scaling and the step's flop count.

Model (stated, not fitted to the answer):

* Step flops of a LoRA fine-tune with a frozen base: per token, forward ``2 P`` (P: the multiply-adds of every
  linear layer, LM head / classifier included) plus attention ``4 L T d_att``; backward ``2 P`` (input gradients only:
  frozen weights get none) plus ``8 L T d_att``; the LoRA branches and the per-example gradients are < 1 % and left
  out.  Tokens per step = examples x length.
* Mechanism flops per module (m x n, rank r), from the code: per example ``2 (2m + n) r^2`` (the r x r Gram norms)
  and ``2 (m + n) r`` (the clipped sums); per step ``~40 (m + n) r^2`` (frames, lift, noise, adaptive step,
  retraction, alignment).
* The exact compensation of LoRA dropout on PRISM's rank-r start (``prismdp.lora.start.StartDropoutCompensation``, every
  started module with dropout): its LoRA branch computes ``(Z - Z0) drop(x)`` with products of width 2r instead of
  r, ``4 (m + n) r`` more flops per token and module (forward ``2 (m + n) r``, input gradient ``2 (m + n) r``; an
  upper bound: the first layer's input gradient is skipped).  Checked against the profiler's exact flop count
  (``python -m bench.profile``): W1 3.6 (model) vs 3.3 GFLOP per step (measured, prism minus
  prism-no-dropout-comp), W2 13.6 vs 13.5.
* Mechanism seconds on this CPU: the micro-benchmark's per-module times (one module, m = n = d, b = 64, r = 16),
  fitted as ``t = a + s (m + n)`` separately for ``accumulate`` (per micro-batch, linear in the examples) and ``step``
  (once per step); a model's stacks of equal-shape modules are one call each (``a`` per stack and call), its modules
  add ``s (m + n)`` each.  Step seconds on this CPU: the step flops at the FLOP rate the non-private step achieved on
  W1 and W2 (measured in the same run).  The model is checked against the measured mechanism share on W1 and W2.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Shape:
    """A model's layout for the estimate."""

    name: str
    modules: List[Tuple[int, int, int]]  # (m, n, count) of the LoRA modules, one entry per stack of equal shapes
    linear_params: float  # multiply-adds per token of every linear layer (LM head / classifier included)
    layers: int
    d_att: int  # attention width (heads x head dim)
    length: int  # tokens per example
    examples: int  # per step
    micro: int  # examples per micro-batch
    r: int = 16
    note: str = ""


def _minilm_linear() -> float:
    d, inter, layers = 384, 1536, 6
    return layers * (4 * d * d + 2 * d * inter) + d * d + 2 * d  # + pooler and the 2-class classifier


def _smollm2_linear() -> float:
    d, kv, inter, layers, vocab = 576, 192, 1536, 30, 49152
    return layers * (2 * d * d + 2 * d * kv + 3 * d * inter) + d * vocab


def _gemma3_4b_linear() -> float:
    d, q, kv, inter, layers, vocab = 2560, 2048, 1024, 10240, 34, 262144
    return layers * (d * q + 2 * d * kv + q * d + 3 * d * inter) + d * vocab


SHAPES: Dict[str, Shape] = {
    "W1": Shape("W1", [(384, 384, 18)], _minilm_linear(), 6, 384, 128, 32, 4,
                note="MiniLM-L6, r 16 on q/k/v, batch 32 as 8 x 4, length 128 (the bench's W1)"),
    "W2": Shape("W2", [(576, 576, 30), (192, 576, 60), (1536, 576, 30), (576, 1536, 30)], _smollm2_linear(), 30, 576,
                128, 8, 4, note="SmolLM2-135M, r 16 on q/k/v/up/down, batch 8 as 2 x 4, length 128 (the bench's W2)"),
    "Gemma-3-4B": Shape(
        "Gemma-3-4B", [(2048, 2560, 34), (1024, 2560, 68), (10240, 2560, 34), (2560, 10240, 34)], _gemma3_4b_linear(),
        34, 2048, 256, 64, 8,
        note="hidden 2560, intermediate 10240, 34 layers, 8 query heads and 4 KV heads of width 256, vocabulary "
             "262,144 (tied head), r 16 on q/k/v/up/down; assumed: batch 64 as 8 x 8, length 256"),
}


def step_flops(s: Shape) -> float:
    tokens = s.examples * s.length
    return tokens * (4 * s.linear_params + 12 * s.layers * s.length * s.d_att)


def mechanism_flops(s: Shape) -> float:
    per_example = sum(c * (2 * (2 * m + n) * s.r ** 2 + 2 * (m + n) * s.r) for m, n, c in s.modules)
    per_step = sum(c * 40 * (m + n) * s.r ** 2 for m, n, c in s.modules)
    return s.examples * per_example + per_step


def compensation_flops(s: Shape) -> float:
    """Extra flops per step of the exact dropout compensation (upper bound, see the module docstring)."""
    return s.examples * s.length * sum(c * 4 * (m + n) * s.r for m, n, c in s.modules)


def _fit(rows: List[dict], key: str) -> Tuple[float, float]:
    """Least-squares ``t = a + s (m + n)`` over the micro-benchmark's rows (those with m + n >= 1024 if there are
    two)."""
    pts = [(r["m"] + r["n"], r[key]) for r in rows if r.get(key) is not None]
    if len([p for p in pts if p[0] >= 1024]) >= 2:  # past the per-call floor of the smallest sizes
        pts = [p for p in pts if p[0] >= 1024]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    return max(my - slope * mx, 0.0), slope


def mechanism_seconds(s: Shape, micro: dict) -> float:
    """Predicted mechanism seconds per step on this CPU (see the module docstring)."""
    b0 = micro["rows"][0]["b"]
    a_acc, s_acc = _fit(micro["rows"], "accumulate_median_s")
    a_step, s_step = _fit(micro["rows"], "step_median_s")
    n_micro = max(1, s.examples // s.micro)
    width = sum(c * (m + n) for m, n, c in s.modules)
    calls = len(s.modules)
    return calls * (n_micro * a_acc + a_step) + width * (s_acc * s.examples / b0 + s_step)


def extrapolate(micro: dict, workloads: List[dict]) -> dict:
    """The table: per shape, step and mechanism flops, the flop share, and on this CPU the predicted mechanism
    seconds, step seconds and share, with the measured share where the bench ran the workload."""
    measured = {w["workload"]: w for w in workloads}
    rates = []
    for name in ("W1", "W2"):  # the FLOP rate the non-private step reaches on this CPU
        v = measured.get(name, {}).get("variants", {}).get("lora-adamw")
        if v:
            rates.append(step_flops(SHAPES[name]) / v["median_s"])
    rate = statistics.fmean(rates) if rates else None
    rows = []
    for name, s in SHAPES.items():
        sf, mf, cf = step_flops(s), mechanism_flops(s), compensation_flops(s)
        mech_s = mechanism_seconds(s, micro)
        step_s = sf / rate if rate else None
        prism = measured.get(name, {}).get("variants", {}).get("prism")
        rows.append({
            "shape": name, "note": s.note, "modules": sum(c for _, _, c in s.modules), "stacks": len(s.modules),
            "examples_per_step": s.examples, "step_flops": sf, "mechanism_flops": mf, "flop_share": mf / sf,
            "compensation_flops": cf, "compensation_flop_share": cf / sf,
            "cpu_mechanism_s": mech_s, "cpu_step_s": step_s,
            "cpu_share": mech_s / (step_s + mech_s) if step_s else None,
            "measured_mechanism_s": prism["mechanism_median_s"] if prism else None,
            "measured_share": prism["mechanism_share"] if prism else None,
        })
    return {"cpu_flop_rate": rate, "rows": rows}


def markdown(ext: dict) -> List[str]:
    rate = ext["cpu_flop_rate"]
    lines = ["## What the mechanism should cost at scale (model; bench/extrapolate.py)", "",
             "Step flops: 4 x (linear multiply-adds) + 12 L T d_att per token (frozen base: input gradients only). "
             "Mechanism flops per module: 2 (2m + n) r^2 + 2 (m + n) r per example, ~40 (m + n) r^2 per step. CPU "
             "seconds: mechanism from the micro-benchmark's accumulate/step fits (a per stack and call, a slope per "
             "unit of m + n), step = flops at the FLOP rate the non-private step reached on W1/W2 here"
             + (f" ({rate / 1e9:.0f} GFLOP/s)." if rate else " (not measured in this run)."), "",
             "Dropout compensation (PRISM's rank-r start with LoRA dropout, exact): 4 (m + n) r flops per token "
             "and module, an upper bound.", "",
             "| shape | modules (stacks) | examples / step | step GFLOP | mechanism GFLOP | flop share | "
             "dropout compensation GFLOP (share) | CPU: mechanism s / step s | CPU share (model) | measured share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ext["rows"]:
        cpu = "-" if r["cpu_step_s"] is None else f"{r['cpu_mechanism_s']:.3f} / {r['cpu_step_s']:.1f}"
        share = "-" if r["cpu_share"] is None else f"{100 * r['cpu_share']:.2f} %"
        meas = "-" if r["measured_share"] is None else f"{100 * r['measured_share']:.2f} %"
        lines.append(f"| {r['shape']} | {r['modules']} ({r['stacks']}) | {r['examples_per_step']} | "
                     f"{r['step_flops'] / 1e9:,.0f} | {r['mechanism_flops'] / 1e9:.2f} | "
                     f"{100 * r['flop_share']:.3f} % | {r['compensation_flops'] / 1e9:,.1f} "
                     f"({100 * r['compensation_flop_share']:.2f} %) | {cpu} | {share} | {meas} |")
    lines += [""] + [f"- {r['shape']}: {r['note']}" for r in ext["rows"]] + [""]
    return lines


def predicted_vs_measured(ext: dict) -> Optional[str]:
    pairs = [(r["shape"], r["cpu_mechanism_s"], r["measured_mechanism_s"]) for r in ext["rows"]
             if r["measured_mechanism_s"]]
    if not pairs:
        return None
    return "; ".join(f"{n}: predicted {p * 1e3:.0f} ms, measured {m * 1e3:.0f} ms per step" for n, p, m in pairs)
