"""A weight sharded by FSDP2 (a ``DTensor``) read and written whole: the gather every storage kind that can be sharded
uses before it reads (:mod:`~prismdp.base.floating`, :mod:`~prismdp.base.nf4`); sharding itself is
:mod:`~prismdp.base.sharded`'s."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["is_sharded", "full_weight", "gather_rows", "assign_weight"]


def is_sharded(model_or_tensor: nn.Module | Tensor) -> bool:
    """Whether a tensor is a ``DTensor``, or any parameter of a module is."""
    if isinstance(model_or_tensor, Tensor):
        return hasattr(model_or_tensor, "device_mesh") and hasattr(model_or_tensor, "full_tensor")
    return any(is_sharded(p) for p in model_or_tensor.parameters())


def full_weight(weight: Tensor) -> Tensor:
    """``weight`` as one ordinary tensor: a sharded weight is all-gathered (a collective: every rank calls it, in the
    same order) and the gather waited for; any other tensor is returned as it is."""
    return _waited(weight.full_tensor()) if is_sharded(weight) else weight


def _waited(t: Tensor) -> Tensor:
    """``t`` once every all-gather writing into it has finished.  ``full_tensor()`` waits for a plain tensor's gather,
    but of a tensor subclass that gathers its inner tensors one by one (torchao's NF4: three) it returns the inner
    tensors with their gathers still in flight (torch 2.13: three works left in the functional-collective registry).
    Read early they may be incomplete; freed early, gloo's thread writes into freed memory (seen: ``malloc():
    unaligned tcache chunk detected`` and an abort in a sharded-NF4 run under load)."""
    from torch.distributed._functional_collectives import wait_tensor

    for name in t.__tensor_flatten__()[0] if hasattr(t, "__tensor_flatten__") else ():
        wait_tensor(getattr(t, name))
    return t


@torch.no_grad()
def gather_rows(local: Tensor, sharded: Tensor) -> Tensor:
    """The whole of a tensor laid out as ``sharded`` is (FSDP2's ``Shard(0)`` over a one-dimensional mesh, equal
    shards) from every rank's ``local`` rows (e.g. its shard de-quantized), by one synchronous c10d all-gather: no
    functional collectives, whose gathers of a tensor subclass's inner tensors can still be in flight when they are
    read or freed (:func:`_waited`).  A collective."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    mesh = sharded.device_mesh
    if mesh.ndim != 1 or tuple(sharded.placements) != (Shard(0),):
        raise ValueError(f"gather_rows: a Shard(0) tensor on a 1-D mesh, got {tuple(sharded.placements)} on a "
                         f"{mesh.ndim}-D mesh")
    group = mesh.get_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    whole = torch.cat(parts)
    if whole.shape != sharded.shape:
        raise ValueError(f"gather_rows: uneven shards ({tuple(whole.shape)} gathered for {tuple(sharded.shape)})")
    return whole


@torch.no_grad()
def assign_weight(weight: Tensor, value: Tensor) -> None:
    """``weight.copy_(value)`` for a full-size ``value`` that every rank holds alike: a sharded ``weight`` keeps only
    its own shard of it (no communication)."""
    if is_sharded(weight):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(weight.dtype), weight.device_mesh, weight.placements, src_data_rank=None)
    weight.copy_(value)
