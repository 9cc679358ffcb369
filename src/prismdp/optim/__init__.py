"""torch.optim-style optimizers: PRISM and the factor-space baselines under the same DP machinery."""

from .baselines import dp_ffa, dp_lamb, dp_lora_plus, dp_lora_rite
from .factor_dp import DPFactorOptimizer, dp_adamw
from .lamb import Lamb
from .prism import PRISM
from .rite import LoraRITE

__all__ = [
    "PRISM",
    "DPFactorOptimizer",
    "Lamb",
    "LoraRITE",
    "dp_adamw",
    "dp_ffa",
    "dp_lamb",
    "dp_lora_plus",
    "dp_lora_rite",
]
