"""Seeded subsets and held-out splits of a list of examples: the one rule every task uses.

``seeded_subset(items, n, seed)`` keeps ``n`` items at ``sorted(random.Random(seed).sample(range(len(items)), n))``
(the order of the source is kept).  ``carve(items, sizes, seed)`` splits off disjoint held-out sets (e.g. a
validation split for tuning, or a test split for a task without a labelled dev set) by one seeded permutation; the
seed is fixed per experiment, not per run, so every run of a grid holds out the same examples.
"""

from __future__ import annotations

import random
from typing import Sequence

__all__ = ["seeded_subset", "carve", "CARVE_SEED"]

CARVE_SEED = 20261123  # held-out splits are the same for every run seed


def seeded_subset(items: Sequence, n: int | None, seed: int) -> list:
    """``n`` items (all of them if ``n`` is None or ``>= len(items)``), in their original order."""
    if n is None or n >= len(items):
        return list(items)
    if n < 1:
        raise ValueError(f"subset size must be >= 1, got {n}")
    idx = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in idx]


def carve(items: Sequence, sizes: Sequence[tuple[str, int]], seed: int = CARVE_SEED) -> tuple[list, dict[str, list]]:
    """Split ``sizes`` = ``[(name, n), ...]`` disjoint held-out sets off ``items``; returns ``(rest, {name: set})``,
    each in the original order.  Raises ``ValueError`` if they would leave no training example."""
    total = sum(n for _, n in sizes)
    if total >= len(items):
        raise ValueError(f"held-out sets of {total} examples ({', '.join(f'{k} {n}' for k, n in sizes)}) leave "
                         f"nothing of the {len(items)} training examples; hold out fewer")
    order = random.Random(seed).sample(range(len(items)), len(items))
    out, start = {}, 0
    for name, n in sizes:
        out[name] = [items[i] for i in sorted(order[start:start + n])]
        start += n
    rest = [items[i] for i in sorted(order[start:])]
    return rest, out
