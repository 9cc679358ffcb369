"""A frozen base sharded across the processes of a run with PyTorch's FSDP2 (``fully_shard``).

For models bigger than one GPU: each of the model's blocks (the classes the model lists in ``_no_split_modules``,
e.g. ``LlamaDecoderLayer``) and then the model itself become FSDP units whose *frozen* weights are split across the
ranks (each rank stores 1/W of them, all-gathered one block at a time for the forward and again for the backward).
The trained tensors (LoRA factors, a head) are ``ignored_params``: plain, replicated tensors trained by the
multi-process mechanism as before (:mod:`prismdp.distributed`: per-example clipping on the rank that holds the
example, the clipped sums all-reduced once per step, the noise drawn once, replicas checked). FSDP never sees a
gradient, so it reduce-scatters nothing.

What changes for the rest of the run:

* every forward and backward is a collective: all ranks must run the same number of micro-steps, in the same order.
  A rank with fewer micro-batches in a logical step runs *idle* ones (:meth:`prismdp.engine.PrivateLoRA.idle`), whose
  gradient is discarded;
* the frozen weight ``W0`` of a LoRA layer is a ``DTensor``: the rank-r start reads it whole one layer at a time
  (:func:`full_weight`) and writes back only each rank's shard (:func:`assign_weight`);
* evaluation runs on every rank (the forward is a collective); rank 0 alone writes the files;
* ``prismdp train --fsdp`` reads the weights on rank 0 alone: the other ranks build the model on the meta device,
  and after sharding every rank receives its shards from rank 0 (:func:`fill_from_rank0`), so host memory holds one
  whole model (rank 0's), not one per process.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

__all__ = ["ShardingError", "check_world", "shard_frozen_base", "fill_from_rank0", "is_sharded", "full_weight",
           "assign_weight", "block_classes"]


class ShardingError(ValueError):
    """The model cannot be sharded as asked."""


def is_sharded(model_or_tensor: nn.Module | Tensor) -> bool:
    """Whether a tensor is a ``DTensor``, or any parameter of a module is."""
    if isinstance(model_or_tensor, Tensor):
        return hasattr(model_or_tensor, "device_mesh") and hasattr(model_or_tensor, "full_tensor")
    return any(is_sharded(p) for p in model_or_tensor.parameters())


def full_weight(weight: Tensor) -> Tensor:
    """``weight`` as one ordinary tensor: a sharded weight is all-gathered (a collective: every rank calls it, in the
    same order); any other tensor is returned as it is."""
    return weight.full_tensor() if is_sharded(weight) else weight


@torch.no_grad()
def assign_weight(weight: Tensor, value: Tensor) -> None:
    """``weight.copy_(value)`` for a full-size ``value`` that every rank holds alike: a sharded ``weight`` keeps only
    its own shard of it (no communication)."""
    if is_sharded(weight):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(weight.dtype), weight.device_mesh, weight.placements, src_data_rank=None)
    weight.copy_(value)


def check_world(world) -> None:
    """Refuse to shard without several processes (before anything is loaded)."""
    if world is None or world.size < 2:
        raise ShardingError("--fsdp shards the base model across the processes of a torchrun job, and this run has one "
                            "process. Fix: start it with `torchrun --nproc-per-node N -m prismdp train --fsdp ...` "
                            "(N >= 2), or leave --fsdp out.")


def block_classes(model: nn.Module) -> set[str]:
    """The class names of the model's repeated blocks: ``_no_split_modules`` of the (PEFT-wrapped) transformers
    model, the units Hugging Face's own FSDP wrapping uses."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set()
    for module in base.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    return names


def shard_frozen_base(model: nn.Module, world, blocks: Iterable[str] | None = None) -> list[nn.Module]:
    """Shard ``model``'s frozen weights across ``world``'s processes with FSDP2, in place: ``fully_shard`` on every
    block (``blocks``: class names; default :func:`block_classes`), then on the transformers model (inside a PEFT
    model's wrappers), each with the trained parameters left out (``ignored_params``).  Returns the sharded modules
    (the root last).  Call it after LoRA is
    on the model and before :func:`prismdp.engine.make_private` (whose rank-r start then gathers one layer at a time).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_world(world)
    if is_sharded(model):
        raise ShardingError("the model is sharded already (it holds DTensor parameters); shard it once")
    names = set(blocks) if blocks is not None else block_classes(model)
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ShardingError(f"no block of {type(model).__name__} to shard: the model lists no _no_split_modules "
                            "(transformers models do). Fix: pass blocks=[<the class name of its layers>].")
    mesh = init_device_mesh(world.device.type, (world.size,))
    trained = {p for p in model.parameters() if p.requires_grad}
    sharded = []
    for unit in units:
        fully_shard(unit, mesh=mesh, ignored_params={p for p in unit.parameters() if p in trained})
        sharded.append(unit)
    # the root unit is the transformers model inside PEFT's wrappers: generate() and PEFT's forward both call its
    # forward, whose hooks gather the weights outside the blocks (embeddings, final norm, head)
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    fully_shard(root, mesh=mesh, ignored_params={p for p in root.parameters() if p in trained})
    sharded.append(root)
    return sharded


def fill_from_rank0(model: nn.Module, world, whole: nn.Module | None) -> None:
    """Give a sharded ``model`` its values from rank 0, where ``whole`` is the same model (LoRA on it) loaded whole
    into host memory (None on the other ranks, whose model was built on the meta device, like ``model`` on rank 0).
    Every rank's model is first materialised on ``world.device`` (shards only); then FSDP's broadcast from rank 0
    fills the parameters (each rank keeps its shard, the replicated LoRA tensors whole) and the buffers (rotary
    frequencies and the like, which a state dict may leave out) are broadcast: every rank then holds what it would
    had it loaded the model itself.  A collective: every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if (world.rank == 0) != (whole is not None):
        raise ShardingError("fill_from_rank0: rank 0 passes the model it loaded, the other ranks None")
    model.to_empty(device=world.device)
    set_model_state_dict(model, whole.state_dict() if whole is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    source = dict(whole.named_buffers()) if whole is not None else {}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if whole is not None:
                buffer.copy_(source[name])
            dist.broadcast(buffer, 0)
