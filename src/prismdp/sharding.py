"""FSDP2 sharding of the frozen base under its old import path: it lives in :mod:`prismdp.base.sharded`, behind the
seam of :mod:`prismdp.base` (:func:`prismdp.base.prepare_base` shards for ``prismdp train --fsdp`` and the Trainer)."""

from .base.sharded import (ShardingError, assign_weight, block_classes, check_torch, check_world, full_weight,
                           is_sharded, shard_frozen_base, shard_from_rank0)

__all__ = ["ShardingError", "check_torch", "check_world", "shard_frozen_base", "shard_from_rank0", "is_sharded", "full_weight",
           "assign_weight", "block_classes"]
