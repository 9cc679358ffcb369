"""The thin QR of PRISM's LoRA factors on a GPU: ``torch.linalg.qr`` (Householder, what :func:`prismdp.geometry.frame`
called on CUDA before ``shifted-cholqr2`` below) against candidates that replace it by matrix products, per batched
shape of one step, with their errors.

:mod:`bench.gpu_profile` found ``torch.linalg.qr`` the largest single GPU cost PRISM adds to a step of the
Llama-3.2-1B shape (32 ms of 0.24 s: cuSOLVER's unblocked ``geqr2`` kernels on a batch of tall, thin matrices).
Candidates, for ``X`` of shape (batch, m, r), m >> r:

==================  ======================================================================================
householder         ``torch.linalg.qr(X)`` in the factors' dtype (float32)
householder-cpu     the same on the CPU, the factors copied there and back (a host synchronisation)
cholqr2-f64         CholeskyQR2 in float64: ``R1 = chol(X^T X)``, ``Q1 = X R1^-1``, again on ``Q1``; products and
                    triangular solves only, r x r work in the Cholesky factorisations
cholqr2-f32         the same in float32 (fails or loses orthogonality once cond(X) ~ 1 / sqrt(eps32) ~ 3e3)
cholqr2-mixed       the Gram matrices and Cholesky factors in float64, the tall solves in float32
shifted-cholqr2     :func:`prismdp.geometry.cholesky_qr`, what PRISM's frames and retraction use on CUDA since
                    this benchmark: cholqr2-f64 with a shift that keeps each factorisation defined for rank-deficient
                    blocks, and no status read (``cholesky_ex``: no host synchronisation)
==================  ======================================================================================

Errors, against float64 arithmetic: ``max |Q^T Q - I|`` and ``||Q R - X|| / ||X||`` on factors whose singular
values span a condition number of 1e1, 1e3 and 1e5 (PRISM keeps balanced factors: cond(A) = sqrt(cond(A B^T))).
Times: medians of ``--reps`` CUDA-synchronised calls after warm-up, per shape.

    python -m bench.studies.gpu_qr                       # Llama-3.2-1B's LoRA shapes, r 16, 16 layers, on cuda
    python -m bench.studies.gpu_qr --tiny --device cpu   # a check of the script

Writes ``OUT/gpu-qr-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

from prismdp import geometry

from ..gpu import environment, refuse, resolve_device, timed_step, write_report

LLAMA_1B = {"q (2048)": 2048, "k, v (512)": 512, "up / down (8192)": 8192}  # the rows of A or B per target family


def cholqr2(X: Tensor, dtype: torch.dtype, gram: torch.dtype | None = None) -> Tuple[Tensor, Tensor]:
    """CholeskyQR2: two passes of ``R = chol(Y^T Y)^T``, ``Y <- Y R^-1``, the tall products and solves in ``dtype``,
    the r x r Gram matrices and their Cholesky factors in ``gram`` (default ``dtype``); returns Q and R in X's dtype."""
    gram = gram or dtype
    Y = X.to(dtype)
    R = None
    for _ in range(2):
        Yg = Y.to(gram)
        L = torch.linalg.cholesky(Yg.mT @ Yg)
        Y = torch.linalg.solve_triangular(L.mT.to(dtype), Y, upper=True, left=False)
        R = L.mT if R is None else L.mT @ R
    return Y.to(X.dtype), R.to(X.dtype)


def _householder_cpu(X: Tensor) -> Tuple[Tensor, Tensor]:
    Q, R = torch.linalg.qr(X.cpu())
    return Q.to(X.device), R.to(X.device)


CANDIDATES: Dict[str, Callable[[Tensor], Tuple[Tensor, Tensor]]] = {
    "householder": torch.linalg.qr,
    "shifted-cholqr2": geometry.cholesky_qr,
    "householder-cpu": _householder_cpu,
    "cholqr2-f64": lambda X: cholqr2(X, torch.float64),
    "cholqr2-f32": lambda X: cholqr2(X, torch.float32),
    "cholqr2-mixed": lambda X: cholqr2(X, torch.float32, gram=torch.float64),
}


def factors(batch: int, m: int, r: int, cond: float, device, seed: int = 0) -> Tensor:
    """A batch of (m, r) float32 matrices with singular values spaced geometrically from 1 to 1 / cond."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(batch, m, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(batch, r, r, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), r, dtype=torch.float64)
    return ((U * s) @ V.mT).to(device=device, dtype=torch.float32)


def errors(X: Tensor, Q: Tensor, R: Tensor) -> dict:
    X, Q, R = X.double(), Q.double(), R.double()
    eye = torch.eye(Q.shape[-1], dtype=torch.float64, device=Q.device)
    return {"orthogonality": (Q.mT @ Q - eye).abs().max().item(),
            "reconstruction": ((Q @ R - X).norm() / X.norm()).item()}


def time_call(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median seconds of ``reps`` CUDA-synchronised calls (:func:`bench.gpu.timed_step`) after ``warmup``."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed_step(fn, device)[0] for _ in range(reps))


def run(shapes: Dict[str, int], batch: int, r: int, device: torch.device, reps: int, conds=(1e1, 1e3, 1e5)) -> dict:
    out = {}
    for label, m in shapes.items():
        X = factors(batch, m, r, 1e1, device)
        conditioned = {cond: factors(batch, m, r, cond, device, seed=1) for cond in conds}  # the same for each
        row = {"m": m, "batch": batch, "r": r, "candidates": {}}
        for name, fn in CANDIDATES.items():
            rec = row["candidates"][name] = {}
            try:
                rec["ms"] = 1e3 * time_call(lambda: fn(X), device, reps)
            except Exception as e:  # noqa: BLE001 -- recorded (e.g. a Cholesky of a numerically singular Gram)
                rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            for cond, Xc in conditioned.items():
                try:
                    rec[f"cond {cond:.0e}"] = errors(Xc, *fn(Xc))
                except Exception as e:  # noqa: BLE001
                    rec[f"cond {cond:.0e}"] = {"error": f"{type(e).__name__}"}
        out[label] = row
    return out


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Thin QR of LoRA factors: {env['device_name']}", "",
             f"{env['date']}, commit {env['commit']}; torch {env['versions']['torch']}. "
             f"Command: `{' '.join(report['command'])}`.", "",
             "| rows m (batch x m x r) | candidate | ms | max abs(Q^T Q - I) at cond 1e1 / 1e3 / 1e5 | "
             "QR - X relative at cond 1e5 |", "|---|---|---:|---|---:|"]
    for label, row in report["shapes"].items():
        for name, rec in row["candidates"].items():
            orth = " / ".join(f"{rec[k]['orthogonality']:.1e}" if "orthogonality" in rec[k] else rec[k]["error"]
                              for k in rec if k.startswith("cond"))
            last = rec.get("cond 1e+05", {})
            recon = f"{last['reconstruction']:.1e}" if "reconstruction" in last else "-"
            ms = f"{rec['ms']:.3f}" if "ms" in rec else rec.get("error", "-")
            lines.append(f"| {label} ({row['batch']} x {row['m']} x {row['r']}) | {name} | {ms} | {orth} | {recon} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.gpu_qr", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default cuda if available, else cpu")
    p.add_argument("--batch", type=int, default=16, help="layers per batched call (Llama-3.2-1B: 16)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="small shapes (a check of the script)")
    p.add_argument("--output", default="bench/results")
    args = p.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        return refuse("python -m bench.studies.gpu_qr", e)
    shapes = {"tiny (64)": 64, "tiny (256)": 256} if args.tiny else LLAMA_1B
    env = environment(device)
    report = {"command": ["python", "-m", "bench.studies.gpu_qr", *(sys.argv[1:] if argv is None else argv)],
              "environment": env,
              "shapes": run(shapes, args.batch if not args.tiny else 2, args.rank if not args.tiny else 4, device,
                            args.reps if not args.tiny else 2)}
    write_report(args.output, "gpu-qr", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
