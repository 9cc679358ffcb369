#!/usr/bin/env bash
# Run issue 28's grid (configs/cpu-minilm-when.yaml: PRISM vs DP-AdamW by step budget, on CoLA/MRPC/RTE, at
# epsilon 1 and 8) in phases, most informative first, each phase with two single-thread processes sharing its cells
# (cells are claimed; finished cells are skipped, interrupted ones resumed, so rerunning this script continues where
# it stopped). The benchmark's own cells (sst2/mnli/qqp at epsilon 3, 6 and non-DP) come from its committed
# results.csv and are not retrained.
#
#   bash scripts/when-grid.sh [OUT]          # default OUT: runs/cpu-minilm-when
#   NICE=19 bash scripts/when-grid.sh        # lower priority (share the machine)
#
# Run it from a worktree pinned to one commit (config.json of every cell records code_version).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu-minilm-when}
CONFIG=configs/cpu-minilm-when.yaml
ARCHIVE=docs/results-cpu/benchmark/results.csv
PRISMDP=${PRISMDP:-.venv/bin/prismdp}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/logs"

phase() {  # phase NAME ARGS...: two processes on the selected cells, wait for both
  local name=$1; shift
  echo "$(date -u +%FT%TZ) phase $name: $*" | tee -a "$OUT/logs/phases.log"
  for p in a b; do
    nice -n "${NICE:-0}" "$PRISMDP" experiment "$CONFIG" --output "$OUT" --results-from "$ARCHIVE" --quiet "$@" \
      >> "$OUT/logs/$name-$p.log" 2>&1 &
  done
  wait
}

phase sst2-x4-eps3 --tasks sst2-x4 --privacy 3
phase sst2-eps1-8 --tasks sst2 --privacy 1,8
phase mnli-x4-eps3 --tasks mnli-x4 --privacy 3
# Does MiniLM learn the new tasks within the budget? Non-private tuning runs of DP-AdamW (seed 42, four rates).
phase new-nondp-check --tasks cola,mrpc,rte --privacy non-dp --methods dp-adamw --seeds 42
phase qqp-x4-eps3 --tasks qqp-x4 --privacy 3
phase sst2-x4-eps6 --tasks sst2-x4 --privacy 6
phase x4-eps6 --tasks mnli-x4,qqp-x4 --privacy 6
"$PRISMDP" experiment "$CONFIG" --output "$OUT" --results-from "$ARCHIVE" --tables-only > "$OUT/logs/tables.log" 2>&1
echo "$(date -u +%FT%TZ) done (the new tasks' private phases are added once the non-DP check says which learn)" \
  | tee -a "$OUT/logs/phases.log"
