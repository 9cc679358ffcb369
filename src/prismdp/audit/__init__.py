"""Privacy auditing: an empirical lower bound on a run's epsilon from one training run with canaries.

- :mod:`.statistics` -- pure functions of canary scores (Steinke, Nasr and Jagielski 2023):
  :func:`one_run_p_value`, :func:`epsilon_one_run` (and :func:`~.statistics.audit_one_run` with the guesses).
- :mod:`.fdp` -- the f-DP test of the same scores (Mahloujifar, Melis and Chaudhuri 2024):
  :func:`~.fdp.audit_one_run_fdp` (a Gaussian-DP mu and its epsilon), :func:`~.fdp.audit_one_run_mechanism` (the
  run's own subsampled-Gaussian family).
- :mod:`.canaries` / :mod:`.scoring` -- white-box gradient canaries: the trainer's injector (an example source of
  the mechanism) and the auditor's scorer (a step hook).
- :mod:`.inputs` -- black-box input canaries (random tokens, random labels) and their losses.
- :mod:`.run` -- ``prismdp audit``: one run, the coins, the scores, ``audit.json``.
"""

from .fdp import audit_one_run_fdp, audit_one_run_mechanism
from .statistics import audit_one_run, epsilon_one_run, one_run_p_value

__all__ = ["audit_one_run", "audit_one_run_fdp", "audit_one_run_mechanism", "epsilon_one_run", "one_run_p_value"]
