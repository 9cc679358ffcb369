#!/usr/bin/env bash
# Rebuild issue 45's decoder tables (docs/results-cpu/decoder/) from the grid's finished cells, with this checkout's
# code:
#
#   bash scripts/decoder-grid-tables.sh /path/to/pinned-worktree/runs/cpu-smollm2-glue [ARCHIVE.csv]
#
# scripts/grid-tables.sh does the work (results.csv, results.md and the grid's phases.log into the docs folder).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/grid-tables.sh configs/cpu-smollm2-glue.yaml docs/results-cpu/decoder \
  "${1:?usage: bash scripts/decoder-grid-tables.sh RUNS_DIR [ARCHIVE.csv]}" "${@:2}"
