"""``python -m prismdp ...`` (what ``torchrun --nproc-per-node W -m prismdp train ...`` runs): the ``prismdp`` CLI."""

import sys

from .cli import main

sys.exit(main())
