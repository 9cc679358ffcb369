"""Per-stack updates run in lockstep, with one batched factorisation per kind and shape for all stacks.

On CUDA every ``torch.linalg.svd`` and ``torch.linalg.eigh`` reads its status on the host (to raise on a failed
factorisation), so each call is a synchronisation, and torch has no ``svd_ex`` / ``eigh_ex`` that would leave the
status on the device.  A PRISM step makes three factorisations per stack of equal-shape LoRA modules (the
preconditioner's ``eigh``, the retraction's and the Procrustes alignment's SVDs); their matrices are r x r or
2r x 2r whatever the module's shape, so the matrices of all stacks can share one call.

An update is written as a generator that *yields* its factorisation requests, ``("svd", X)`` or ``("eigh", X)``,
and receives the result (``(U, S, Vh)`` or ``(w, Q)``), so each stack's code stays one readable sequence.
:func:`run_in_lockstep` advances all generators together; in each round the requests of the same kind, matrix shape,
dtype and device are concatenated into one call and the results split back.  On the CPU the results are those of
separate calls bit for bit (LAPACK factorises a batch one matrix at a time).
"""

from __future__ import annotations

from typing import Any, Generator

import torch
from torch import Tensor

__all__ = ["FACTORISATIONS", "Update", "run_in_lockstep", "answer"]

#: the requests an update may yield: names of ``torch.linalg`` functions
FACTORISATIONS = ("svd", "eigh")

#: a per-stack update: yields ``(name, matrix)`` requests, receives their results, returns its own result
Update = Generator[tuple[str, Tensor], Any, Any]


def _call(name: str, X: Tensor) -> tuple[Tensor, ...]:
    # looked up at call time, so a test can count the calls
    return tuple(getattr(torch.linalg, name)(X))


def answer(requests: list[tuple[str, Tensor]]) -> list[tuple[Tensor, ...]]:
    """Results of ``requests``, one factorisation call per (kind, matrix shape, dtype, device): leading (batch)
    dimensions are flattened, concatenated and restored."""
    for name, X in requests:
        if name not in FACTORISATIONS:
            raise ValueError(f"unknown factorisation {name!r}; one of {', '.join(FACTORISATIONS)}")
    groups: dict[tuple, list[int]] = {}
    for j, (name, X) in enumerate(requests):
        groups.setdefault((name, tuple(X.shape[-2:]), X.dtype, X.device), []).append(j)
    out: list = [None] * len(requests)
    for (name, _, _, _), members in groups.items():
        if len(members) == 1:
            out[members[0]] = _call(name, requests[members[0]][1])
            continue
        mats = [requests[j][1] for j in members]
        flat = [X if X.dim() == 3 else X.reshape(-1, *X.shape[-2:]) for X in mats]
        results = _call(name, torch.cat(flat))
        parts = [r.split([f.shape[0] for f in flat]) for r in results]
        for n, (j, X) in enumerate(zip(members, mats)):
            out[j] = tuple(p[n] if X.dim() == 3 else p[n].reshape(*X.shape[:-2], *p[n].shape[1:]) for p in parts)
    return out


def run_in_lockstep(updates: list[Update]) -> list:
    """Run the generators together until all return; returns their return values in order."""
    results: list = [None] * len(updates)
    pending: dict[int, tuple[str, Tensor]] = {}
    for i, u in enumerate(updates):
        _advance(updates, i, None, pending, results)
    while pending:
        order = sorted(pending)
        answers = answer([pending.pop(i) for i in order])
        for i, a in zip(order, answers):
            _advance(updates, i, a, pending, results)
    return results


def _advance(updates: list[Update], i: int, value, pending: dict, results: list) -> None:
    try:
        pending[i] = updates[i].send(value)
    except StopIteration as stop:
        results[i] = stop.value
