"""The per-example causal-LM loss on a GPU: forward + backward of the loss alone on fixed bf16 logits of a benchmark
shape, with its errors and memory.

:mod:`bench.gpu_profile` (``bench/results/gpu-h200-cholqr``) found prismdp's chunked eager cross-entropy the largest
kernel time it adds to a Llama-3.2-1B step: about fifteen float32 passes per 64 MiB chunk (``amax``, ``sub``,
``exp``, ``sum``, ``mul_``, ``scatter_add_``, copies), 17 ms against the model's own loss's 8 ms, and ~1,000 kernel
launches.  Variants:

=========  ===========================================================================================
own        transformers' ``ForCausalLMLoss`` on the logits (what ``model(..., labels=)`` computes: a float32
           copy of the logits, one token mean over the micro-batch); the reference, not per-example
eager      :func:`prismdp.losses.causal_lm_losses` with ``fused=False`` (the chunked eager loss)
fused      the same with ``fused=True`` (``torch.compile``'d chunk kernels; the CUDA default)
=========  ===========================================================================================

Errors, against the float64 formula on the same bf16 values (the first two examples): the per-example loss
(relative) and the gradient (absolute, of ``sum(loss_i * w_i)`` with weights in [-1, 2]).  Times: medians of
``--reps`` CUDA-synchronised forward + backward calls after warm-up (the first call's time, with the compilation,
is reported apart); memory: peak allocated above the logits during one call.

    python -m bench.gpu_loss                        # Llama-3.2-1B (32 x 256, vocabulary 128,256) and Gemma-3 shapes
    python -m bench.gpu_loss --tiny --device cpu    # a check of the script

Writes ``OUT/gpu-loss-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable, Dict

import torch
from torch import Tensor

from prismdp.losses import causal_lm_losses

from .gpu import environment, refuse, resolve_device, timed_step, write_report

SHAPES = {"llama-3.2-1b (32 x 256 x 128,256)": (32, 256, 128256), "gemma-3 (16 x 256 x 262,144)": (16, 256, 262144)}
TINY = {"tiny (2 x 16 x 1,000)": (2, 16, 1000)}


def _own(logits: Tensor, labels: Tensor) -> Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


VARIANTS: Dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "own": _own,
    "eager": lambda x, y: causal_lm_losses(x, y, fused=False),
    "fused": lambda x, y: causal_lm_losses(x, y, fused=True),
}


def _dense(logits: Tensor, labels: Tensor) -> Tensor:
    x, y = logits[:, :-1].double(), labels[:, 1:]
    tok = torch.logsumexp(x, dim=2) - x.gather(2, y.unsqueeze(2)).squeeze(2)
    return tok.mean(dim=1)


def errors(fn, logits: Tensor, labels: Tensor) -> dict:
    """Per-example loss and gradient of the first two examples against the float64 formula (``own``: its token mean
    against the mean of theirs, gradient not compared: a different loss)."""
    x = logits[:2].detach().clone().requires_grad_()
    ref_x = logits[:2].detach().double().requires_grad_()
    ref = _dense(ref_x, labels[:2])
    got = fn(x, labels[:2])
    if got.dim() == 0:
        return {"loss_rel": ((got.double() - ref.mean()).abs() / ref.mean().abs()).item()}
    w = torch.tensor([-1.0, 2.0], dtype=torch.float64, device=x.device)
    (got.double() * w).sum().backward()
    (ref * w).sum().backward()
    return {"loss_rel": ((got.double() - ref).abs() / ref.abs()).max().item(),
            "grad_abs": (x.grad.double() - ref_x.grad).abs().max().item()}


def run(shapes: dict, device: torch.device, reps: int, warmup: int = 2) -> dict:
    out = {}
    for label, (b, T, V) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        logits = (2 * torch.randn(b, T, V, generator=g, device=device)).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, V, (b, T), generator=g, device=device)
        row = out[label] = {"shape": [b, T, V], "variants": {}}
        for name, fn in VARIANTS.items():
            rec = row["variants"][name] = {}

            def step(fn=fn):
                fn(logits, labels).sum().backward()
                logits.grad = None

            try:
                rec["first_call_s"] = timed_step(step, device)[0]  # with the compilation, for fused
                for _ in range(warmup):
                    step()
                runs = [timed_step(step, device) for _ in range(reps)]
                rec["ms"] = 1e3 * statistics.median(t for t, _ in runs)
                peaks = [p for _, p in runs if p is not None]
                rec["peak_above_logits_gb"] = max(peaks) / 1e9 if peaks else None
                rec.update(errors(fn, logits, labels))
            except Exception as e:  # noqa: BLE001 -- recorded (e.g. out of memory for one variant)
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Per-example causal-LM loss: {env['device_name']}", "",
             f"{env['date']}, commit {env['commit']}; torch {env['versions']['torch']}. "
             f"Command: `{' '.join(report['command'])}`. Forward + backward of the loss alone on fixed bf16 logits.",
             "", "| shape | variant | ms | / own | first call (s) | peak above logits (GB) | loss rel. error | "
             "grad abs. error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for label, row in report["shapes"].items():
        own = row["variants"].get("own", {}).get("ms")
        for name, rec in row["variants"].items():
            if "error" in rec:
                lines.append(f"| {label} | {name} | {rec['error']} | | | | | |")
                continue
            ratio = f"{rec['ms'] / own:.2f}" if own else "-"
            peak = f"{rec['peak_above_logits_gb']:.2f}" if rec.get("peak_above_logits_gb") is not None else "-"
            grad = f"{rec['grad_abs']:.1e}" if "grad_abs" in rec else "-"
            lines.append(f"| {label} | {name} | {rec['ms']:.2f} | {ratio} | {rec['first_call_s']:.2f} | {peak} | "
                         f"{rec['loss_rel']:.1e} | {grad} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default cuda if available, else cpu")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="a small shape (a check of the script)")
    p.add_argument("--output", default="bench/results")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        return refuse("python -m bench.gpu_loss", e)
    env = environment(device)
    report = {"command": ["python", "-m", "bench.gpu_loss", *(sys.argv[1:] if argv is None else argv)],
              "environment": env, "shapes": run(TINY if args.tiny else SHAPES, device, 2 if args.tiny else args.reps)}
    write_report(args.output, "gpu-loss", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
