"""What the CPU benchmarks share: the interleaved round that times every variant under the same machine load, the
record of where a result was measured, and the atomic write of a result file.

Both ``python -m bench`` (:mod:`bench.__main__`) and the trainer's jobs (:mod:`bench.train_job`) import it; it
imports no other module of ``bench`` but the package itself.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Dict

import torch

from prismdp.atomic import write_text

from . import code_commit


def interleaved_round(parts: Dict[str, list], clock, interleave: str = "micro") -> Dict[str, float]:
    """One step of every variant (``parts[name]``: its step as callables, micro-batches then update), timed with
    ``clock``: variant after variant (``step``: A B C D) or part after part (``micro``: the first micro-batch of
    A B C D, then the second ..., the variant order rotated from part to part), so that every variant's step is
    measured under the same machine load to within one micro-batch's time.  Returns each variant's step time."""
    names = list(parts)
    took = dict.fromkeys(names, 0.0)
    if interleave == "step":
        for n in names:
            t = clock()
            for part in parts[n]:
                part()
            took[n] = clock() - t
        return took
    for j in range(max(len(p) for p in parts.values())):
        k = j % len(names)
        for n in names[k:] + names[:k]:
            if j < len(parts[n]):
                t = clock()
                parts[n][j]()
                took[n] += clock() - t
    return took


def environment(threads: int) -> dict:
    """Where and on what a CPU result was measured: date, commit (:func:`bench.code_commit`), torch, threads, CPUs,
    machine."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": code_commit(),
            "torch": torch.__version__, "threads": threads, "cpus": os.cpu_count(),
            "machine": f"{platform.machine()} {platform.processor() or platform.system()}"}


def write(path: Path, text: str) -> None:
    """``text`` to ``path`` atomically (:func:`prismdp.atomic.write_text`), its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text)
