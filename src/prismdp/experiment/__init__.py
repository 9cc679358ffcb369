"""The paper's experiments as runnable grids: ``prismdp experiment CONFIG.yaml``.

* :mod:`.grid` -- the YAML format (methods x privacy settings x tasks x seeds) and one TrainConfig per cell;
* :mod:`.runner` -- trains the cells into ``OUT/<cell id>/``, skipping finished ones, resuming interrupted ones;
* :mod:`.tables` -- ``results.csv`` and the Table-2 style ``results.md`` / ``results.tex``;
* :mod:`.tuning` -- the learning rate of each (task, method, setting) chosen on held-out training data;
* :mod:`.archive` -- finished cells read back from an earlier ``results.csv`` (``--results-from``).

Shipped grids: ``configs/paper-gemma3-4b.yaml`` (the paper's Appendix B setting) and the CPU stand-ins
``configs/cpu-minilm-glue.yaml`` and ``configs/cpu-smollm2-math.yaml``.
"""

from .grid import Cell, Experiment, Setting, load_experiment, parse_set_overrides, parse_setting
from .runner import ExperimentRun, config_mismatch, run_experiment
from .tables import build_table, read_cell, render_latex, render_markdown, write_results

__all__ = [
    "Cell",
    "Experiment",
    "ExperimentRun",
    "Setting",
    "build_table",
    "config_mismatch",
    "load_experiment",
    "parse_set_overrides",
    "parse_setting",
    "read_cell",
    "render_latex",
    "render_markdown",
    "run_experiment",
    "write_results",
]
