"""Privacy auditing: an empirical lower bound on a run's epsilon from one training run with canaries.

- :mod:`.statistics` -- pure functions of canary scores (Steinke, Nasr and Jagielski 2023):
  :func:`one_run_p_value`, :func:`epsilon_one_run`.
"""

from .statistics import epsilon_one_run, one_run_p_value

__all__ = ["epsilon_one_run", "one_run_p_value"]
