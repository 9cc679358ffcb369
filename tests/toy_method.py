"""A toy method, added to prismdp through its public registry only (this file is all it takes): plain DP-SGD on the
LoRA factors, i.e. the factor-space mechanism (per-example clipping of every trained tensor together, Gaussian noise
on every coordinate) in front of ``torch.optim.SGD``."""

import torch

from prismdp.engine import register_method
from prismdp.optim import DPFactorOptimizer

NAME = "toy-dp-sgd"
LABEL = "DP-SGD"
LR = {"glue": 0.05, "math": 0.05, "demo": 0.5}


def build(pairs, dense_params, *, lr, mechanism, momentum=0.0):
    """SGD over the trained factors (and dense parameters), wrapped in the mechanism unless non-private."""
    dense_params = list(dense_params)
    params = [p for pair in pairs for p in pair.trained_params] + dense_params
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    return opt if mechanism is None else DPFactorOptimizer(opt, pairs, dense_params, mechanism=mechanism)


def register():
    return register_method(NAME, build, label=LABEL, lr=LR)
