"""Mechanism micro-benchmark: one LoRA module, b per-example gradients, rank r, m = n growing.

* ``prism``: prismdp's PRISM math for one private step on given per-example factor gradients -- intrinsic norms,
  global clip, clipped sums, lift, tangent noise, rank-space adaptive direction, retraction -- i.e.
  ``PRISM.accumulate(grads); PRISM.step()`` on a real PEFT LoRA layer.  O(b (m + n) r^2).
* ``dense``: the dense reference for the part that PRISM's factored formulas replace: per example, form the
  m x n gradient ``G_i = D_i^T X_i`` from T = 16 tokens, project it onto the tangent space, take its norm, clip and
  sum; then add the projection of an m x n Gaussian.  O(b m n (T + r)) and m x n memory; a lower bound on any
  dense implementation (it stops before the lift and the retraction).

Also counts host synchronisations (``item``, ``tolist``, ``float(t)``, ``bool(t)``, ...) inside one PRISM step.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

SYNC_FUNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "__array__", "nonzero",
              "masked_select", "unique", "__len__"}
#: factorisations that read their status on the host on CUDA (to raise on failure): no tensor is read in Python,
#: but each is a device synchronisation there (the ``_ex`` variants and QR are not)
STATUS_FUNCS = {"linalg_svd", "linalg_svdvals", "linalg_eigh", "linalg_eigvalsh", "linalg_eig", "linalg_eigvals",
                "linalg_cholesky", "linalg_inv", "linalg_solve", "linalg_pinv", "linalg_lstsq"}


class HostSyncCounter(TorchFunctionMode):
    """Counts tensor operations that copy a value to the host (``count``: a device synchronisation on a GPU) and,
    apart, factorisations that read their status on the host on CUDA (``status_reads``, :data:`STATUS_FUNCS`)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.status_reads = 0
        self.names: Dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_FUNCS:
            self.count += 1
            self.names[name] = self.names.get(name, 0) + 1
        elif name in STATUS_FUNCS:
            self.status_reads += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _OneLinear(nn.Module):
    def __init__(self, m: int, n: int):
        super().__init__()
        self.proj = nn.Linear(n, m, bias=False)

    def forward(self, x):
        return self.proj(x)


def _prism_setup(m: int, n: int, r: int, b: int, seed: int = 0):
    from prismdp.grad_sample import PerExampleGrads
    from prismdp.lora import find_lora_pairs, move_to_rank_r_start
    from prismdp.optim import PRISM
    from prismdp.privacy.clipping import DPConfig
    from prismdp.privacy.mechanism import GaussianMechanism
    from prismdp.train.build import build_lora_model
    from prismdp.train.config import TrainConfig

    torch.manual_seed(seed)
    model = build_lora_model(TrainConfig(rank=r, alpha=r, dropout=0.0, target_modules=["proj"]), _OneLinear(m, n))[0]
    pairs = find_lora_pairs(model)
    move_to_rank_r_start(pairs, init="random", generator=torch.Generator().manual_seed(seed))
    opt = PRISM(pairs, lr=1e-3, mechanism=GaussianMechanism(DPConfig(1.0, 1.0, float(b)),
                                                         generator=torch.Generator().manual_seed(seed)))
    g = torch.Generator().manual_seed(seed + 1)
    gbt, ga = torch.randn(1, b, r, m, generator=g), torch.randn(1, b, r, n, generator=g)  # the sampler's layout
    grads = PerExampleGrads(b, [(gbt[0].mT, ga[0].mT)], stacks=[[0]], stacked=[(gbt, ga)])
    return opt, grads


def _time(fn, steps: int, warmup: int) -> List[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def prism_step_times(m: int, n: int, r: int, b: int, steps: int, warmup: int):
    """Seconds per PRISM step (accumulate + step), and separately per ``accumulate`` (the per-example part: norms,
    clipping, sums) and per ``step`` (lift, noise, adaptive direction, retraction: independent of b)."""
    opt, grads = _prism_setup(m, n, r, b)
    parts = {"accumulate": [], "step": []}

    def step():
        t0 = time.perf_counter()
        opt.accumulate(grads)
        t1 = time.perf_counter()
        opt.step()
        parts["accumulate"].append(t1 - t0)
        parts["step"].append(time.perf_counter() - t1)

    times = _time(step, steps, warmup)
    parts = {k: v[warmup:] for k, v in parts.items()}
    with HostSyncCounter() as counter:
        step()
    return times, counter, parts


def dense_step_times(m: int, n: int, r: int, b: int, steps: int, warmup: int, tokens: int = 16):
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(m, r, generator=g), torch.randn(n, r, generator=g)
    D, X = torch.randn(b, tokens, m, generator=g), torch.randn(b, tokens, n, generator=g)
    C = 1.0

    def step():
        QA, _ = torch.linalg.qr(A)
        QB, _ = torch.linalg.qr(B)

        def proj(G):
            PG = QA @ (QA.T @ G)
            return PG + (G - PG) @ QB @ QB.T

        acc = torch.zeros(m, n)
        for i in range(b):
            P = proj(D[i].T @ X[i])
            acc.add_(P, alpha=float((C / (P.norm() + 1e-12)).clamp(max=1.0)))
        acc.add_(proj(torch.randn(m, n, generator=g)))
        return acc / b

    return _time(step, steps, warmup)


def run_micro(sizes: List[int], r: int = 16, b: int = 64, steps: int = 5, warmup: int = 2, dense_max: int = 4096,
              log=print) -> dict:
    rows = []
    for d in sizes:
        times, counter, parts = prism_step_times(d, d, r, b, steps, warmup)
        row = {"m": d, "n": d, "r": r, "b": b, "prism_median_s": statistics.median(times), "prism_times_s": times,
               "accumulate_median_s": statistics.median(parts["accumulate"]),
               "step_median_s": statistics.median(parts["step"]),
               "host_syncs_per_step": counter.count, "host_sync_ops": counter.names}
        if d <= dense_max:
            dt = dense_step_times(d, d, r, b, max(2, steps // 2), 1)
            row.update(dense_median_s=statistics.median(dt), dense_times_s=dt,
                       dense_over_prism=statistics.median(dt) / row["prism_median_s"])
        else:
            row.update(dense_median_s=None, dense_skipped=f"m = n > {dense_max} (dense per-example m x n cost)")
        log(f"[micro] m = n = {d}: prism {row['prism_median_s'] * 1e3:.2f} ms"
            + (f", dense {row['dense_median_s'] * 1e3:.1f} ms ({row['dense_over_prism']:.0f}x)"
               if row.get("dense_median_s") else ", dense skipped")
            + f", host syncs {counter.count}")
        rows.append(row)
    by = {row["m"]: row["prism_median_s"] for row in rows}
    scaling = by[8192] / by[1024] if 8192 in by and 1024 in by else None
    return {"rows": rows, "prism_8192_over_1024": scaling}
