"""How tests/test_tune.py's reference epsilons were computed: with Papernot and Steinke's public code for "Hyperparameter
Tuning with Renyi Differential Privacy" (ICLR 2022), tensorflow/privacy, research/hyperparameters_2022/ (commit
03035d5d4a271ac795dab80f5bc1cef82fc3d462): its ``rdp_accountant.py`` (the subsampled Gaussian's RDP, RDP -> (eps, delta))
and the ``repeat_*_rdp`` functions of ``figure7.py``.  Not part of the test suite, and none of that code is in prismdp.

    python -m venv /tmp/ref-venv && /tmp/ref-venv/bin/pip install numpy scipy six
    git clone https://github.com/tensorflow/privacy && cd privacy/research/hyperparameters_2022
    PYTHONPATH=. /tmp/ref-venv/bin/python /path/to/prismdp/tests/reference/tuning_reference.py

It prints one line per case of ``test_tune.REFERENCE``: (count, sigma, q, steps, score sigma, trial eps, total eps).
The orders are dp_accounting's DEFAULT_RDP_ORDERS; gamma is found from the mean by bisection here (the paper's
Definition 1 mean, written out below), independently of prismdp.
"""
import math

import numpy as np

import rdp_accountant  # from research/hyperparameters_2022 (the working directory)

src = open("figure7.py").read().split("if load_values_to_reproduce_paper_fig:")[0]
ns = {}
exec(src.replace("import matplotlib.pyplot as plt", ""), ns)  # the repeat_*_rdp functions only

ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
DELTA = 1e-5


def mean_of(gamma, eta):  # Definition 1: E[K] of the truncated negative binomial (eta = 0: logarithmic)
    return (1 / gamma - 1) / math.log(1 / gamma) if eta == 0 else eta * (1 - gamma) / (gamma * (1 - gamma ** eta))


def gamma_of(mean, eta):
    lo, hi = 1e-12, 1 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_of(mid, eta) > mean else (lo, mid)
    return (lo + hi) / 2


for spec in ("geometric:10", "poisson:10", "negative-binomial:0.5:10", "logarithmic:10"):
    for sigma, q, steps, score in ((1.0, 0.01, 1000, None), (1.5, 0.02, 300, 10.0), (4.0, 1.0, 1, None)):
        rdp = rdp_accountant.compute_rdp(q, sigma, steps, ORDERS)
        if score:
            rdp = rdp + rdp_accountant.compute_rdp(1.0, score, 1, ORDERS)
        if spec.startswith("geometric"):
            out = ns["repeat_geometric_rdp"](ORDERS, rdp, gamma_of(10, 1))
        elif spec.startswith("logarithmic"):
            out = ns["repeat_logarithmic_rdp"](ORDERS, rdp, gamma_of(10, 0))
        elif spec.startswith("negative"):
            out = ns["repeat_negativebinomial_rdp"](ORDERS, rdp, gamma_of(10, 0.5), 0.5)
        else:
            out = ns["repeat_poisson_rdp"](ORDERS, rdp, 10)
        trial = rdp_accountant.get_privacy_spent(ORDERS, rdp, target_delta=DELTA)[0]
        total = rdp_accountant.get_privacy_spent(ORDERS, np.array(out, dtype=float), target_delta=DELTA)[0]
        print(f"    ({spec!r}, {sigma!r}, {q!r}, {steps!r}, {score!r}, {trial:.10g}, {total:.10g}),")
