#!/usr/bin/env bash
# Issue 45 item 2: what honest tuning does to the PRISM vs DP-AdamW comparison, on the benchmark's SST-2 and MNLI
# settings, total epsilon 3 and 8, seeds 42-44, paired:
#   (b) first (short), then (a).
#   (a) honest: configs/cpu-minilm-honest.yaml, every cell a `prismdp tune` over the benchmark's four rates, paid for
#       inside the cell's epsilon (docs/tuning.md; 24 cells, 96 runs);
#   (b) no tuning: configs/cpu-minilm-notune.yaml, the README's starting rates, the whole budget in one run (24 runs);
#   (c) free tuning: already measured (docs/results-cpu/benchmark for epsilon 3, docs/results-cpu/when for 8).
# Two single-thread processes share each grid (cells are claimed; rerunning this script continues where it stopped:
# a tuning resumes with its saved draw, finished cells are skipped). Run it from a worktree pinned to one commit.
#
#   bash scripts/honest-grid.sh [OUT]        # default OUT: runs/cpu-minilm-honest (arm b in OUT/notune)
#   NICE=19 bash scripts/honest-grid.sh      # lower priority (share the machine)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu-minilm-honest}
PRISMDP=${PRISMDP:-.venv/bin/prismdp}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/logs"

phase() {  # phase NAME CONFIG OUTPUT: two processes on the grid, wait for both
  local name=$1 config=$2 out=$3
  echo "$(date -u +%FT%TZ) phase $name: $config -> $out" | tee -a "$OUT/logs/phases.log"
  for p in a b; do
    nice -n "${NICE:-0}" $PRISMDP experiment "$config" --output "$out" --quiet >> "$OUT/logs/$name-$p.log" 2>&1 &
  done
  wait
}
# arm (b) first: 24 runs, a complete arm within a few hours; then arm (a)'s 96
phase notune configs/cpu-minilm-notune.yaml "$OUT/notune"
phase honest configs/cpu-minilm-honest.yaml "$OUT"
echo "$(date -u +%FT%TZ) done" | tee -a "$OUT/logs/phases.log"
