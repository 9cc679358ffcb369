"""The plain storage: a float weight (any dtype), whole or sharded by FSDP (:mod:`prismdp.base.sharded`).  The one
storage the rank-r start may write ``W0 - Z0`` into; registered last, it holds whatever no other kind holds."""

from __future__ import annotations

from .dtensor import assign_weight, full_weight
from .storage import Storage, register_storage

FLOAT = register_storage(Storage("float", holds=lambda layer: True, read=lambda layer: full_weight(layer.weight),
                                 write=lambda layer, value: assign_weight(layer.weight, value)))
