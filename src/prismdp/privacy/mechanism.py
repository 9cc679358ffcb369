"""The subsampled Gaussian mechanism of a training run, in one object.

Every DP optimizer of prismdp (PRISM and the factor-space methods) releases, once per logical batch,

    ( map(sum_i alpha_i g_i)  +  sigma C xi ) / b,     alpha_i = min(1, C / ||g_i||),  b = q N (expected batch size)

where ``||.||`` is the method's own per-example norm, ``map`` a linear map of the clipped sums (PRISM: the canonical
lift to the tangent space; factor space: the identity) and ``xi`` noise of the method's own law (PRISM: isotropic
tangent noise; factor space: iid N(0, 1) per coordinate).  :class:`GaussianMechanism` owns everything that makes that
release private, so it is written once:

    accumulate()   per micro-batch: clipping coefficients from the squared norms (non-finite examples count 0 and are
                   counted), clipped sums per trained tensor, clipping statistics (on the device, no host sync)
    release()      per logical batch: budget check (refused before any noise is drawn) -> reduce the sums and the
                   statistics across processes (identity in one process) -> + the clipped sums of any extra examples
                   (:meth:`GaussianMechanism.attach_example_source`: the audit's canaries) -> map -> + sigma C xi,
                   drawn once for the global sum -> / b -> budget record

A method supplies its :class:`Coordinates`: zero sums of the right shapes, ``signal`` (the linear map) and ``noise``
(the map from iid N(0, 1) draws, one per sum tensor and shaped like it, to its noise law).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .clipping import ClippedSum, ClipStats, DPConfig, clipped_sum, contributing, noise_generator
from .secure import SecureRandom, TorchNoise

__all__ = ["Coordinates", "Euclidean", "ExampleSource", "GaussianMechanism", "PerExample", "Release", "Reduce"]

#: In-place SUM of a list of tensors across the processes of a run (identity in one process).
Reduce = Callable[[list[Tensor]], None]

#: Examples that do not come from the data sampler (the audit's gradient canaries): called once per release with the
#: method's :class:`Coordinates`, returns the clipped sum of this step's such examples shaped like ``coords.zeros()``
#: (each example already clipped to C in the method's norm), or ``None`` when none is in this step's sample.
ExampleSource = Callable[["Coordinates"], "list[Tensor] | None"]


class PerExample(NamedTuple):
    """Per-example tensors of one trained quantity: ``values`` has the example dimension ``dim`` (0, or 1 for
    (k, b, ...) stacks); the clipped sum is multiplied by ``scale`` and its last two dimensions are swapped if
    ``transpose``."""

    values: Tensor
    dim: int = 0
    scale: float = 1.0
    transpose: bool = False


class Coordinates(Protocol):
    """How a method's clipped sums are read and its noise is shaped (see the module docstring)."""

    def zeros(self) -> list[Tensor]: ...

    def signal(self, sums: list[Tensor]) -> list[Tensor]: ...

    def noise(self, draws: list[Tensor]) -> list[Tensor]: ...


class Euclidean:
    """Coordinates of plain DP-SGD on tensors of the given shapes: identity maps, iid N(0, 1) noise."""

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, devices: Sequence[torch.device]):
        self.shapes, self.dtype, self.devices = list(shapes), dtype, list(devices)

    def zeros(self) -> list[Tensor]:
        return [torch.zeros(s, dtype=self.dtype, device=d) for s, d in zip(self.shapes, self.devices)]

    def signal(self, sums: list[Tensor]) -> list[Tensor]:
        return sums

    def noise(self, draws: list[Tensor]) -> list[Tensor]:
        return draws


@dataclass
class Release:
    """One logical batch's output of the mechanism.

    ``values`` are the released tensors (everything an optimizer does with them is post-processing); ``noise`` is
    the noise that went into them, ``sigma C xi`` before the division by ``b`` (``None`` for sigma = 0): what
    diagnostics and audits measure, never to be logged with the data.  ``clip`` holds the batch's clipping statistics
    (summed over processes).
    """

    values: list[Tensor]
    noise: list[Tensor] | None
    clip: ClipStats


class GaussianMechanism:
    """Clipping, clipped sums, noise, budget and statistics of the subsampled Gaussian mechanism.

    Args:
        dp: the public constants (noise multiplier sigma, clipping bound C, expected batch size b = q N).
        generator: the noise source: a torch generator (``None`` seeds a new one on ``device`` from OS entropy), one
            wrapped in :class:`~prismdp.privacy.secure.TorchNoise` (saying where its seed came from), or a
            :class:`~prismdp.privacy.secure.SecureRandom` (``--secure-noise``: ChaCha20, Holohan-Braghin normals).
        budget: optional :class:`~prismdp.privacy.PrivacyBudget` (anything with ``check_step()`` /
            ``record_step()``): a release that would exceed it is refused before any noise is drawn.
        reduce: in-place SUM of the clipped sums and statistics across processes (:mod:`prismdp.privacy.distributed`);
            ``None`` in one process.  The noise is drawn after the reduction, once for the global sum.
        always_mask: mask non-contributing examples even when every example is finite (by default the masking pass
            is skipped on the CPU when every coefficient is > 0; the result is the same).
    """

    def __init__(self, dp: DPConfig, *, generator: torch.Generator | TorchNoise | SecureRandom | None = None,
                 budget=None, reduce: Reduce | None = None, device: torch.device | str = "cpu",
                 always_mask: bool = False):
        self.dp = dp
        self.budget = budget
        self.reduce = reduce
        self.always_mask = always_mask
        if isinstance(generator, SecureRandom):
            self.generator, self.noise_source = None, generator
        elif isinstance(generator, TorchNoise):
            self.generator, self.noise_source = generator.generator, generator
        else:
            self.generator = noise_generator(torch.device(device), generator)
            self.noise_source = TorchNoise(self.generator)
        self.clip = ClippedSum(dp.max_grad_norm)
        self._sums: list[Tensor] | None = None
        self._sources: OrderedDict[int, ExampleSource] = OrderedDict()

    def attach_example_source(self, source: ExampleSource) -> RemovableHandle:
        """Add ``source``'s examples to every release from now on (after the cross-process reduction: a source adds
        its examples once to the global sum, so it must return the same tensors on every rank).  Its examples are
        not counted in the clipping statistics.  Returns a handle with ``remove()``."""
        handle = RemovableHandle(self._sources)
        self._sources[handle.id] = source
        return handle

    @property
    def noise_std(self) -> float:
        """sigma C: the noise standard deviation on the summed clipped updates."""
        return self.dp.noise_std

    @property
    def expected_batch_size(self) -> float:
        return float(self.dp.expected_batch_size)

    @property
    def release_std(self) -> float:
        """sigma C / b: the per-coordinate noise standard deviation of the release."""
        return self.dp.noise_std / float(self.dp.expected_batch_size)

    def reset(self) -> None:
        """Forget the current logical batch (sums and statistics)."""
        self._sums = None
        self.clip.reset()

    @property
    def sums(self) -> list[Tensor] | None:
        """The clipped sums accumulated since the last release (``None`` if nothing was), before reduce and noise."""
        return self._sums

    @torch.no_grad()
    def accumulate(self, sq_norms: Tensor, per_example: Sequence[PerExample], coords: Coordinates) -> Tensor:
        """Clip one micro-batch: ``sq_norms`` (b,) are the squared per-example norms (summed over everything trained),
        ``per_example`` the tensors to sum, in the order of ``coords.zeros()``.  Returns the coefficients."""
        coef = self.clip.coefficients(sq_norms)
        keep = (coef > 0) if self.always_mask else contributing(coef)
        if self._sums is None:
            self._sums = coords.zeros()
        for s, pe in zip(self._sums, per_example, strict=True):
            summed = clipped_sum(coef, pe.values, keep, dim=pe.dim)
            s.add_(summed.mT if pe.transpose else summed, alpha=pe.scale)
        return coef

    def _reduce(self, sums: list[Tensor], clip: ClipStats) -> ClipStats:
        stats = clip.stacked().to(sums[0].device)
        self.reduce(sums + [stats])
        return ClipStats(*stats.unbind())

    @torch.no_grad()
    def release(self, coords: Coordinates) -> Release:
        """The noisy release of the logical batch (an empty Poisson batch releases noise only); resets the sums."""
        if self.budget is not None:
            self.budget.check_step()
        sums = self._sums if self._sums is not None else coords.zeros()
        clip = self.clip.take()
        self._sums = None
        if self.reduce is not None:
            clip = self._reduce(sums, clip)
        for source in list(self._sources.values()):
            extra = source(coords)
            if extra is not None:
                sums = [s + e for s, e in zip(sums, extra, strict=True)]
        signal = coords.signal(sums)
        b, std = float(self.dp.expected_batch_size), self.dp.noise_std
        noise = None
        if std > 0:
            draws = self.noise_source.normals([(s.shape, s.dtype, s.device) for s in sums])
            noise = [std * xi for xi in coords.noise(draws)]
            values = [(s + n) / b for s, n in zip(signal, noise)]
        else:
            values = [s / b for s in signal]
        if self.budget is not None:
            self.budget.record_step()
        return Release(values, noise, clip)

    def state_dict(self) -> dict[str, Any]:
        """The noise generator and the budget (sums are never checkpointed: checkpoints fall between steps)."""
        return {"generator": self.noise_source.state_dict(),
                "budget": self.budget.state_dict() if self.budget is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noise_source.load_state_dict(state["generator"])
        if self.budget is not None:
            if state.get("budget") is None:
                raise ValueError("the checkpoint holds no privacy budget, but this run is private with a budget")
            self.budget.load_state_dict(state["budget"])
        self.reset()
