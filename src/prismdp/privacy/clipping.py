"""Per-example clipping and Gaussian noise, independent of any geometry.

A DP optimizer hands :class:`ClippedSum` the squared per-example norms of one micro-batch (summed over every
trained tensor, in the optimizer's own geometry) and gets back the clipping coefficients
``alpha_i = min(1, C / s_i)``.  A non-finite norm is not an error (a crash would reveal that example): its
coefficient is 0, so the example contributes nothing, and it is counted.  Statistics stay on the device as
tensors; nothing here synchronises with the host.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DPConfig", "ClippedSum", "ClipStats", "clipped_sum", "contributing", "gaussian_like", "noise_generator"]


@dataclass(frozen=True)
class DPConfig:
    """The Gaussian mechanism's public constants.

    ``expected_batch_size`` is ``q N`` under Poisson sampling: the noisy sum is divided by it, never by the
    realised batch size (which is private).
    """

    noise_multiplier: float
    max_grad_norm: float
    expected_batch_size: float

    def __post_init__(self):
        if not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if not self.expected_batch_size > 0:
            raise ValueError(
                f"expected_batch_size must be > 0 (sample_rate * dataset_size), got {self.expected_batch_size}"
            )

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise on the *summed* clipped gradients: sigma C."""
        return self.noise_multiplier * self.max_grad_norm


@dataclass(frozen=True)
class ClipStats:
    """Clipping statistics of one logical batch, as device tensors (no synchronisation until :meth:`as_dict`)."""

    examples: Tensor
    clipped: Tensor
    coef_sum: Tensor
    nonfinite: Tensor
    norm_sum: Tensor

    def stacked(self) -> Tensor:
        """The five statistics as one (5,) tensor on their device, in :meth:`summary`'s order (no read)."""
        return torch.stack([self.examples, self.clipped, self.coef_sum, self.nonfinite, self.norm_sum])

    def as_dict(self) -> dict[str, float]:
        """Host-side summary: one read of the five statistics, stacked (a single host synchronisation; call once
        per logical step at most)."""
        return self.summary(self.stacked().tolist())

    @staticmethod
    def summary(values: list[float]) -> dict[str, float]:
        """The summary of the five numbers of :meth:`stacked`, read to the host."""
        n, clipped, coef_sum, nonfinite, norm_sum = values
        return {
            "batch_size": n,
            "clip_fraction": clipped / n if n else 0.0,
            "clip_coef_mean": coef_sum / n if n else 1.0,
            "grad_norm_mean": norm_sum / n if n else 0.0,
            "nonfinite": nonfinite,
        }


class ClippedSum:
    """Clipping coefficients and running statistics of one logical batch."""

    def __init__(self, max_grad_norm: float):
        self.max_grad_norm = float(max_grad_norm)
        self.device = torch.device("cpu")  # where the counters live: the coefficients' device once one is seen
        self.reset()

    def reset(self) -> None:
        """Zero counters, made on the counters' device (a fill there: no copy from the host, no wait)."""
        counters = torch.zeros(5, dtype=torch.float64, device=self.device)
        self.examples, self.clipped, self.coef_sum, self.nonfinite, self.norm_sum = counters.unbind()

    def coefficients(self, sq_norms: Tensor) -> Tensor:
        """(b,) squared global norms -> (b,) coefficients ``min(1, C / s_i)``, 0 where not finite."""
        finite = torch.isfinite(sq_norms)
        norms = torch.where(finite, sq_norms, torch.zeros_like(sq_norms)).clamp_min(0).sqrt()
        coef = (self.max_grad_norm / (norms + 1e-12)).clamp(max=1.0)
        coef = torch.where(finite, coef, torch.zeros_like(coef))
        if self.device != coef.device:  # the first batch on this device (once): the counters move there and stay
            self.device = coef.device
            for name in ("examples", "clipped", "coef_sum", "nonfinite", "norm_sum"):
                setattr(self, name, getattr(self, name).to(coef.device))
        self.examples += coef.numel()
        self.clipped += ((coef < 1.0) & finite).sum()
        self.coef_sum += coef.sum(dtype=torch.float64)
        self.nonfinite += (~finite).sum()
        self.norm_sum += norms.sum(dtype=torch.float64)
        return coef

    def snapshot(self) -> ClipStats:
        return ClipStats(self.examples, self.clipped, self.coef_sum, self.nonfinite, self.norm_sum)

    def stats(self) -> dict[str, float]:
        """Host-side summary (synchronises)."""
        return self.snapshot().as_dict()

    def take(self) -> ClipStats:
        """The batch's statistics (still on the device), and a reset for the next batch."""
        out = self.snapshot()
        self.reset()
        return out


def contributing(coef: Tensor) -> Tensor | None:
    """The (b,) mask of examples that contribute (coefficient > 0), for :func:`clipped_sum`.

    ``None`` when every example contributes and that is free to know: on the CPU, where reading one value costs
    nothing, this saves :func:`clipped_sum` a masking pass over the per-example gradients.  On accelerators the
    mask is always returned, so the step never waits for the device.
    """
    keep = coef > 0
    if coef.device.type == "cpu" and bool(keep.all()):
        return None
    return keep


_AUTO = object()


def clipped_sum(coef: Tensor, per_example: Tensor, keep=_AUTO, dim: int = 0) -> Tensor:
    """``sum_i coef_i * per_example_i`` over the example dimension ``dim`` (0 or 1; 1 for (k, b, ...) stacks).

    Examples with coefficient 0 (non-finite gradients) contribute exactly zero, even where their entries are NaN:
    ``keep`` is the mask from :func:`contributing` (computed here if not given; ``None`` = every example counts).
    """
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1, got {dim}")
    if keep is _AUTO:
        keep = coef > 0
    if keep is not None:
        shape = [1] * per_example.dim()
        shape[dim] = -1
        per_example = torch.where(keep.view(shape), per_example, 0.0)
    if dim == 0:
        return torch.tensordot(coef, per_example, dims=1)
    k, b = per_example.shape[:2]  # (k, b, ...): one (1, b) @ (b, rest) product per k, no permuted copy
    return (coef.to(per_example.dtype) @ per_example.reshape(k, b, -1)).view(k, *per_example.shape[2:])


def gaussian_like(t: Tensor, std: float, generator: torch.Generator | None) -> Tensor:
    """Independent N(0, std^2) entries shaped like ``t``."""
    return torch.randn(t.shape, generator=generator, dtype=t.dtype, device=t.device) * std


def noise_generator(device: torch.device | str, generator: torch.Generator | None = None,
                    seed: int | None = None) -> torch.Generator:
    """``generator`` itself, or a new torch generator *of* ``device`` (the noise is drawn where the parameters are,
    with that device's own algorithm: :func:`prismdp.privacy.secure.describe_torch_generator`), seeded with ``seed``
    or, without one, from OS entropy (not reproducible by design)."""
    if generator is not None:
        return generator
    fresh = torch.Generator(device=torch.device(device))
    fresh.manual_seed(secrets.randbits(63) if seed is None else seed)
    return fresh
