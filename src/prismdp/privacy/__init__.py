"""Privacy plumbing: Poisson sampling, accounting, sigma calibration, budget tracking. Knows nothing of LoRA."""

from .accounting import (BudgetExhaustedError, PrivacyBudget, calibrate_sigma, check_delta, epsilon,
                         report_steps)
from .sampling import PoissonSampler, split_micro_batches

__all__ = [
    "BudgetExhaustedError",
    "PoissonSampler",
    "PrivacyBudget",
    "calibrate_sigma",
    "check_delta",
    "epsilon",
    "report_steps",
    "split_micro_batches",
]
