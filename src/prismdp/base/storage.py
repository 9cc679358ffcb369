"""The registry of storage kinds: how a frozen linear layer holds its weight, and what the rest of prismdp may do
with it (read it whole, write ``W0 - Z0`` into it, keep its layout).  Each kind is one module of this package and one
:func:`register_storage` call in it; :mod:`prismdp.base` imports the modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor, nn

__all__ = ["BaseError", "Storage", "STORAGES", "register_storage", "storage_of"]


class BaseError(ValueError):
    """The frozen base cannot be stored, or trained, as asked (the message names the fix)."""


@dataclass(frozen=True)
class Storage:
    """One way a frozen layer holds its weight.

    ``holds(layer)``: whether ``layer``'s weight is held this way; ``read(layer)``: the weight (out, in) as the
    layer multiplies by it, whole on every rank (de-quantized, a shard all-gathered: one layer's copy);
    ``write(layer, value)``: store a full-size ``value`` that every rank holds alike, or None where the storage has
    no room for it (the rank-r start then stays in the LoRA branch); ``keep_layout(layer)``: a fix that keeps the
    layer computing what it trains on (run on every layer when a model is described), or None."""

    name: str
    holds: Callable[[nn.Module], bool]
    read: Callable[[nn.Module], Tensor]
    write: Callable[[nn.Module, Tensor], None] | None = None
    keep_layout: Callable[[nn.Module], None] | None = None

    @property
    def writable(self) -> bool:
        return self.write is not None


STORAGES: list[Storage] = []  # asked in order; the plain float storage, which holds anything, comes last


def register_storage(storage: Storage) -> Storage:
    """Add a storage kind, asked before the plain float fallback (``name`` must be new)."""
    if any(s.name == storage.name for s in STORAGES):
        raise ValueError(f"storage {storage.name!r} is already registered")
    fallback = [s for s in STORAGES if s.name == "float"]
    STORAGES[:] = [s for s in STORAGES if s.name != "float"] + [storage] + fallback
    return storage


def storage_of(layer: nn.Module) -> Storage:
    """The storage kind of ``layer``'s weight (the first registered kind that holds it)."""
    return next(s for s in STORAGES if s.holds(layer))
