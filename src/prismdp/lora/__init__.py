"""PEFT LoRA pairs as points on the rank-r manifold (:mod:`~prismdp.lora.pairs`: finding and validating them, their
factors ``Z = A B^T``) and the rank-r start that puts them on it (:mod:`~prismdp.lora.start`: ``W0`` read and
``W0 - Z0`` written through the seam of :mod:`prismdp.base`; ``Z0`` kept in the LoRA branch through PEFT's
LoRA-variant interface where the base cannot take it or LoRA dropout is on)."""

from .pairs import (LoraPair, LoraSetupError, find_lora_pairs, freeze_lora_A, get_factors, quantized_base, set_factors,
                    stack_by_shape)
from .start import RankRStart, StartDropoutCompensation, StartInBranch, base_weight, move_to_rank_r_start

__all__ = ["LoraPair", "LoraSetupError", "find_lora_pairs", "freeze_lora_A", "get_factors", "set_factors",
           "stack_by_shape", "quantized_base", "RankRStart", "StartDropoutCompensation", "StartInBranch",
           "move_to_rank_r_start", "base_weight"]
