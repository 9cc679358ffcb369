"""Poisson subsampling, the sampling scheme the accountants analyse.

Each step includes every example independently with probability ``q``: batch sizes vary and may be zero, and
an empty batch is still a step (it releases pure noise and is accounted like any other). Normalise by the
*expected* batch size ``q * N``, never by the realised one.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from .secure import SecureRandom

__all__ = ["PoissonSampler", "split_micro_batches"]

T = TypeVar("T", Tensor, Sequence)


class PoissonSampler:
    """Iterable over ``steps`` Poisson batches of indices into a dataset of ``dataset_size`` examples.

    Each batch is a sorted ``torch.long`` tensor of indices, each index included independently with
    probability ``sample_rate``. ``generator`` is a seed (int), a CPU ``torch.Generator`` (used and advanced in
    place), a :class:`~prismdp.privacy.secure.SecureRandom` (``--secure-noise``: inclusions from ChaCha20; a resume
    continues with the sampler's new key) or None (a fresh, non-deterministically seeded torch generator). The
    sampler is a fixed schedule: iterating continues from the current step and ends after ``steps`` batches in
    total; :meth:`state_dict` and :meth:`load_state_dict` resume it mid-run with exactly the batches an uninterrupted
    run would produce (torch generators; a secure sampler resumes with fresh draws).

    ``shard=(rank, world_size)``: the sampler of one process of a multi-process run draws the inclusion of its own
    examples ``rank, rank + world_size, ...`` only (with its own generator, independent of the other ranks'); the
    union over the ranks is one Poisson sample of the whole dataset, and the expected batch size stays q N.
    """

    def __init__(
        self, dataset_size: int, sample_rate: float, steps: int,
        generator: int | torch.Generator | SecureRandom | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, numbers.Integral) or dataset_size < 1:
            raise ValueError(f"dataset_size must be an integer >= 1, got {dataset_size!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real) or not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be a probability in (0, 1], got {sample_rate!r}")
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
        rank, world = shard
        if not 0 <= rank < world:
            raise ValueError(f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard!r}")
        self.dataset_size, self.sample_rate, self.steps = int(dataset_size), float(sample_rate), int(steps)
        self.shard = (int(rank), int(world))
        self.step = 0  # batches produced so far
        self.generator = _make_generator(generator)

    @property
    def expected_batch_size(self) -> float:
        """``q * N``: the public normaliser of the noisy sum."""
        return self.sample_rate * self.dataset_size

    def describe(self) -> dict[str, str]:
        """Where the inclusions come from, read from the generator in use (the privacy report's
        ``sampling_source``)."""
        if isinstance(self.generator, SecureRandom):
            return {"generator": self.generator.describe()["generator"],
                    "inclusion": "float64 uniforms (53 bits) < q, one key per process"}
        return {"generator": "torch cpu generator (Mersenne Twister)", "inclusion": "float64 uniforms < q"}

    def __len__(self) -> int:
        """Batches still to come."""
        return self.steps - self.step

    def __iter__(self) -> Iterator[Tensor]:
        rank, world = self.shard
        owned = len(range(rank, self.dataset_size, world))
        while self.step < self.steps:
            # float64 uniforms: inclusion probability equals q up to 2^-53
            if isinstance(self.generator, SecureRandom):
                u = self.generator.uniform(owned)
            else:
                u = torch.rand(owned, generator=self.generator, dtype=torch.float64)
            self.step += 1
            yield torch.nonzero(u < self.sample_rate).flatten() * world + rank

    def state_dict(self) -> dict[str, Any]:
        """Step counter and generator state, for checkpoints."""
        return {
            "dataset_size": self.dataset_size,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "shard": self.shard,
            "step": self.step,
            "generator_state": self.generator.state_dict() if isinstance(self.generator, SecureRandom)
            else self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the schedule (dataset_size, sample_rate, steps) must match."""
        saved = {**state, "shard": tuple(state.get("shard", (0, 1)))}
        for key in ("dataset_size", "sample_rate", "steps", "shard"):
            if saved.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler checkpoint has {key}={state.get(key)!r} but this sampler has {getattr(self, key)!r}"
                )
        if not 0 <= state["step"] <= self.steps:
            raise ValueError(f"sampler checkpoint step {state['step']!r} is outside [0, {self.steps}]")
        saved_secure = isinstance(state["generator_state"], dict)
        if saved_secure != isinstance(self.generator, SecureRandom):
            raise ValueError("sampler checkpoint and this sampler differ in --secure-noise; resume with the run's own "
                             "setting")
        if saved_secure:
            self.generator.load_state_dict(state["generator_state"])  # no key is saved: the new key continues
        else:
            self.generator.set_state(state["generator_state"].clone())
        self.step = int(state["step"])


def _make_generator(generator: int | torch.Generator | SecureRandom | None) -> torch.Generator | SecureRandom:
    if isinstance(generator, SecureRandom):
        return generator
    if isinstance(generator, torch.Generator):
        if generator.device.type != "cpu":
            raise ValueError(f"generator must be a CPU torch.Generator, got one on {generator.device}")
        return generator
    if generator is None:
        g = torch.Generator()
        g.seed()
        return g
    if isinstance(generator, numbers.Integral) and not isinstance(generator, bool):
        return torch.Generator().manual_seed(int(generator))
    raise TypeError(f"generator must be an int seed, a torch.Generator or None, got {type(generator).__name__}")


def split_micro_batches(indices: T, micro_batch_size: int) -> Iterator[T]:
    """Consecutive chunks of at most ``micro_batch_size`` indices (nothing for an empty input)."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, numbers.Integral) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
    for start in range(0, len(indices), micro_batch_size):
        yield indices[start : start + micro_batch_size]
