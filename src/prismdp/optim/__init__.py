"""torch.optim-style optimizers: PRISM and the factor-space baselines under the same DP machinery."""

from .factor_dp import DPFactorOptimizer, dp_adamw
from .prism import PRISM

__all__ = ["PRISM", "DPFactorOptimizer", "dp_adamw"]
