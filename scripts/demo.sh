#!/usr/bin/env bash
# Fresh machine -> .venv/ -> the embedded default job: PRISM DP-LoRA (epsilon 3) on the packaged MiniLM-L6 encoder,
# on prismdp's built-in generated review task. Prints test accuracy next to the epsilon spent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/prismdp train --output "${1:-runs/demo}"
