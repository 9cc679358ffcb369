"""Which sentence features of the packaged MiniLM can a DP-trained head use?  (docs/results-cpu.md)

Frozen all-MiniLM-L6-v2 features of the 1,250-example SST-2 training sample (seed 42, the grid's sample) and of the
validation split, three ways: the [CLS] state, the masked mean of the last hidden states, BERT's pooler(CLS).
For each: a non-private logistic regression (sklearn) and a DP linear probe -- per-example gradients of the
cross-entropy, clipped at C = 1, summed, Gaussian noise at the sigma prismdp calibrates for (epsilon, 1e-5) under
Poisson sampling (PRV), Adam step -- at three learning rates, three seeds.  Writes a CSV (one row per setting).

    python scripts/minilm_linear_probe.py --data ../shared/data/glue --out docs/results-cpu/linear-probe.csv
"""

from __future__ import annotations

import argparse
import csv

import torch

from prismdp.data.glue import load_glue
from prismdp.data.glue8 import seeded_subset
from prismdp.heads import masked_mean
from prismdp.models import load_model
from prismdp.privacy.accounting import calibrate_sigma


@torch.no_grad()
def features(model, tok, examples, max_length=64):
    out = {"cls": [], "mean": [], "pooler": []}
    for i in range(0, len(examples), 64):
        enc = tok([e.text_a for e in examples[i:i + 64]], padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt")
        res = model.bert(**enc)
        out["cls"].append(res.last_hidden_state[:, 0])
        out["mean"].append(masked_mean(res.last_hidden_state, enc["attention_mask"]))
        out["pooler"].append(res.pooler_output)
    return {k: torch.cat(v).double() for k, v in out.items()}


def dp_probe(X, y, Xv, yv, *, steps, batch, epsilon, lr, seed, C=1.0, delta=1e-5):
    n = len(X)
    q = batch / n
    sigma = calibrate_sigma(epsilon, delta, q, steps) if epsilon else 0.0
    g = torch.Generator().manual_seed(seed)
    theta = torch.zeros(2, X.shape[1] + 1, dtype=torch.float64)  # [W | b]
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    Xb1 = torch.cat([X, torch.ones(n, 1, dtype=X.dtype)], 1)
    for t in range(1, steps + 1):
        idx = (torch.rand(n, generator=g) < q).nonzero().squeeze(1)
        xb = Xb1[idx]
        r = torch.softmax(xb @ theta.T, 1)
        r[torch.arange(len(idx)), y[idx]] -= 1
        G = r.unsqueeze(2) * xb.unsqueeze(1)  # (b, 2, d + 1) per-example gradients
        G = G * (C / G.flatten(1).norm(dim=1).clamp(min=C)).view(-1, 1, 1)
        grad = (G.sum(0) + sigma * C * torch.randn(theta.shape, generator=g, dtype=theta.dtype)) / batch
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        theta -= lr * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
    Xv1 = torch.cat([Xv, torch.ones(len(Xv), 1, dtype=Xv.dtype)], 1)
    return float(((Xv1 @ theta.T).argmax(1) == yv).double().mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/glue")
    ap.add_argument("--out", default="linear-probe.csv")
    args = ap.parse_args()
    from sklearn.linear_model import LogisticRegression

    torch.manual_seed(0)
    model, tok = load_model(None, "seq_cls", 2)
    train = seeded_subset(load_glue("sst2", "train", args.data), 1250, 42)
    val = load_glue("sst2", "validation", args.data)
    F, Fv = features(model, tok, train), features(model, tok, val)
    y, yv = torch.tensor([e.label for e in train]), torch.tensor([e.label for e in val])
    rows = []
    for kind in F:
        X, Xv = F[kind], Fv[kind]
        norm = float(X.norm(dim=1).mean())
        mu = X.mean(0)
        cos = float((X @ mu / X.norm(dim=1) / mu.norm()).mean())
        logreg = LogisticRegression(C=1.0, max_iter=2000).fit(X.numpy(), y.numpy()).score(Xv.numpy(), yv.numpy())
        rows.append({"features": kind, "probe": "logreg (C=1, non-private)", "acc_mean": round(logreg, 4),
                     "feature_norm": round(norm, 3), "cos_to_mean": round(cos, 3)})
        for steps, batch in ((30, 64), (40, 64), (100, 32)):
            for eps in (None, 6.0, 3.0):
                for lr in (1e-3, 5e-3, 2e-2):
                    accs = [dp_probe(X, y, Xv, yv, steps=steps, batch=batch, epsilon=eps, lr=lr, seed=s)
                            for s in range(3)]
                    rows.append({"features": kind, "probe": f"{steps}x{batch} eps {eps or 'non-dp'} lr {lr:g}",
                                 "acc_mean": round(sum(accs) / 3, 4), "acc_runs": " ".join(f"{a:.3f}" for a in accs),
                                 "feature_norm": round(norm, 3), "cos_to_mean": round(cos, 3)})
                    print(rows[-1], flush=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["features", "probe", "acc_mean", "acc_runs", "feature_norm", "cos_to_mean"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
