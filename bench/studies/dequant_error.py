"""The de-quantization error of a quantized base (issue 27): the packaged SmolLM2-135M in float32 against the same
weights quantized by bitsandbytes (NF4 4-bit, LLM.int8 8-bit; ``prismdp.models.quantize_linear_layers``), on three
fixed sentences.  An adapter exported from a run on the quantized base computes on the original float base exactly
this much differently from the trained model (``(W0 - Q(W0)) x``, layer by layer), and nothing else.

    PYTHONPATH=src python -m bench.studies.dequant_error [--output bench/results/memory]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.", "Add 3 and 4. The answer is 7.",
         "Differential privacy bounds what one example can change in the output of a training run."]


def measure() -> dict:
    from prismdp.models import load_model, quantize_linear_layers

    model, tok = load_model(None, "causal_lm")
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    mask = enc["attention_mask"].bool()
    out = {}
    with torch.no_grad():
        ref = model(**enc, labels=labels)
        for kind in ("4bit", "8bit"):
            q = copy.deepcopy(model)
            quantize_linear_layers(q, kind)
            o = q(**enc, labels=labels)
            d = (o.logits - ref.logits)[mask]
            out[kind] = {"loss_float32": float(ref.loss), "loss_quantized": float(o.loss),
                         "max_abs_logit_diff": float(d.abs().max()),
                         "max_abs_logit": float(ref.logits[mask].abs().max()),
                         "relative_rms_logit_diff": float(d.norm() / ref.logits[mask].norm()),
                         "top1_agreement": float((o.logits.argmax(-1) == ref.logits.argmax(-1))[mask].float().mean())}
            del q
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.dequant_error", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="bench/results/memory")
    args = p.parse_args(argv)
    from bench.common import environment, write

    res = measure()
    env = environment(torch.get_num_threads())
    lines = ["# De-quantization error of SmolLM2-135M", "", f"{env['date']}, commit {env['commit']}, torch "
             f"{env['torch']}. Float32 base (the packaged GGUF, de-quantized on load) against the same weights "
             "quantized by bitsandbytes; 3 sentences, next-token loss and logits over their tokens.", "",
             "| base | loss | relative RMS logit difference | max abs logit difference | top-1 agreement |",
             "|---|---|---|---|---|", f"| float32 | {res['4bit']['loss_float32']:.4f} | 0 | 0 | 1 |"]
    for kind, r in res.items():
        lines.append(f"| {kind} | {r['loss_quantized']:.4f} | {r['relative_rms_logit_diff']:.4f} | "
                     f"{r['max_abs_logit_diff']:.2f} (of {r['max_abs_logit']:.1f}) | {r['top1_agreement']:.3f} |")
    out = Path(args.output)
    write(out / "dequant_error.json", json.dumps({"environment": env, "results": res}, indent=2) + "\n")
    write(out / "dequant_error.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
