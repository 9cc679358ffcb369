#!/usr/bin/env bash
# Rebuild issue 28's tables (docs/results-cpu/when/) from the grid's finished cells, with this checkout's code:
#
#   bash scripts/when-grid-tables.sh /path/to/pinned-worktree/runs/cpu-minilm-when [ARCHIVE.csv]
#
# scripts/grid-tables.sh does the work; the benchmark's own cells count as done too, and budget.png is copied with
# results.csv and results.md.
set -euo pipefail
cd "$(dirname "$0")/.."
FILES="results.csv results.md budget.png" FIXED=docs/results-cpu/benchmark/results.csv \
  exec bash scripts/grid-tables.sh configs/cpu-minilm-when.yaml docs/results-cpu/when \
  "${1:?usage: bash scripts/when-grid-tables.sh RUNS_DIR [ARCHIVE.csv]}" "${@:2}"
