"""``prismdp experiment`` restricted to some cells of a tuned grid, for the pinned worktree of issue 28's grid.

The pinned commit (1e573d9) ignores ``--seeds`` on a tuned grid (it trains every seed at the chosen rate; fixed in
766691a).  This runs its own ``prismdp experiment`` with the plan's to-do list filtered: ``ONLY_SEEDS`` (comma
separated, default all) and ``ONLY_CELLS`` (a regular expression searched in each cell id, default all).  Only the
choice of cells changes; every run is trained by the pinned code and its config.json names that commit.

    ONLY_SEEDS=42 ONLY_CELLS='lr0\\.(0003|001)__' python scripts/when-grid-select.py experiment CONFIG ...
"""

import os
import re
import sys

from prismdp.experiment import tuning

SEEDS = {int(s) for s in os.environ.get("ONLY_SEEDS", "").split(",") if s}
CELLS = re.compile(os.environ.get("ONLY_CELLS", ""))
_todo = tuning.Plan.todo
tuning.Plan.todo = lambda self: [c for c in _todo(self) if (not SEEDS or c.config.seed in SEEDS)
                                 and CELLS.search(c.id)]

from prismdp.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
