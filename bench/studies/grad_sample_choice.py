"""Which per-example gradient engine for LoRA layers? Own hooks vs Opacus GradSampleModule vs torch.func.

Times forward + backward + per-example LoRA factor gradients for one micro-batch on the packaged MiniLM-L6
(LoRA r 16 on query/key/value, micro-batch 4, length 128), interleaved, after warm-up.  Writes
bench/results/grad_sample_choice.json.  Run: ``python -m bench.studies.grad_sample_choice``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from prismdp.grad_sample import GradSampler
from prismdp.lora import find_lora_pairs, move_to_rank_r_start
from prismdp.losses import classification_losses
from prismdp.models import default_encoder_path
from prismdp.train.build import build_lora_model
from prismdp.train.config import TrainConfig

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results


def build():
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(default_encoder_path(), num_labels=2)
    cfg = TrainConfig(rank=16, alpha=16, dropout=0.0, target_modules=["query", "key", "value"])
    model = build_lora_model(cfg, base, "seq_cls")[0]
    model.train()
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs)
    return model, pairs


def main(steps: int = 10, warmup: int = 3, b: int = 4, T: int = 128):
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    ids = torch.randint(1000, 20000, (b, T))
    mask = torch.ones(b, T, dtype=torch.long)
    y = torch.randint(0, 2, (b,))

    model, pairs = build()
    sampler = GradSampler(model, pairs)

    def own():
        with sampler.record() as rec:
            classification_losses(model(input_ids=ids, attention_mask=mask).logits, y).sum().backward()
        sampler.grads(rec)
        model.zero_grad(set_to_none=True)

    from opacus.grad_sample import GradSampleModule

    omodel, _ = build()
    gsm = GradSampleModule(omodel, loss_reduction="sum")

    def opacus():
        classification_losses(gsm(input_ids=ids, attention_mask=mask).logits, y).sum().backward()
        for p in omodel.parameters():
            p.grad_sample = None
            p.grad = None

    fmodel, _ = build()
    params = {n: p.detach() for n, p in fmodel.named_parameters() if p.requires_grad}
    buffers = {n: p.detach() for n, p in fmodel.named_parameters() if not p.requires_grad}
    buffers.update(dict(fmodel.named_buffers()))

    def loss_one(pr, i, m, t):
        out = torch.func.functional_call(fmodel, {**buffers, **pr}, kwargs=dict(input_ids=i[None], attention_mask=m[None]))
        return classification_losses(out.logits, t[None]).sum()

    per_ex = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0, 0), randomness="different")

    def func():
        per_ex(params, ids, mask, y)

    engines = {"own_hooks": own, "opacus_gsm": opacus, "torch_func": func}
    times = {k: [] for k in engines}
    for k, fn in list(engines.items()):
        try:
            for _ in range(warmup):
                fn()
        except Exception as e:  # report engines that cannot run this model
            print(f"{k}: failed: {type(e).__name__}: {e}")
            del engines[k]
            times[k] = None
    for _ in range(steps):
        for k, fn in engines.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    res = {k: (statistics.median(v) if v else None) for k, v in times.items()}
    base = res["own_hooks"]
    out = {"workload": f"MiniLM-L6 seq-cls, LoRA r16 q/k/v, micro-batch {b}, length {T}", "median_s": res,
           "ratio_to_own_hooks": {k: (v / base if v else None) for k, v in res.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grad_sample_choice.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
