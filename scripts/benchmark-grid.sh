#!/usr/bin/env bash
# Run the CPU utility benchmark (configs/cpu-minilm-benchmark.yaml) in phases, most informative first, each phase
# with two single-thread processes sharing its cells (cells are claimed; finished cells are skipped, interrupted ones
# resumed, so rerunning this script continues where it stopped).
#
#   bash scripts/benchmark-grid.sh [OUT]          # default OUT: runs/cpu-minilm-benchmark
#   NICE=19 bash scripts/benchmark-grid.sh        # lower priority (share the machine)
#
# Run it from a worktree pinned to one commit (config.json of every cell records code_version).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu-minilm-benchmark}
CONFIG=configs/cpu-minilm-benchmark.yaml
PRISMDP=${PRISMDP:-.venv/bin/prismdp}
MAIN="prism,prism-ref,dp-adamw,lora-plus,ffa,lamb,lora-rite"
ABLATIONS="a-geometry,a-scalar,a-nofloor,a-lift,a-ref-nolift,a-nodebias,a-noclamp,a-random,a-adamw-rankr,a-sgd"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/logs"

phase() {  # phase NAME ARGS...: two processes on the selected cells, wait for both
  local name=$1; shift
  echo "$(date -u +%FT%TZ) phase $name: $*" | tee -a "$OUT/logs/phases.log"
  for p in a b; do
    nice -n "${NICE:-0}" "$PRISMDP" experiment "$CONFIG" --output "$OUT" --quiet "$@" >> "$OUT/logs/$name-$p.log" 2>&1 &
  done
  wait
}

phase sst2-eps3 --tasks sst2 --privacy 3 --methods "$MAIN"
phase qqp-eps3 --tasks qqp --privacy 3 --methods "$MAIN"
phase ablations --tasks sst2 --privacy 3 --methods "$ABLATIONS"
phase mnli-eps3 --tasks mnli --privacy 3 --methods "$MAIN"
phase eps6 --privacy 6 --methods "$MAIN"
phase nondp --privacy non-dp --methods "$MAIN"
"$PRISMDP" experiment "$CONFIG" --output "$OUT" --tables-only > "$OUT/logs/tables.log" 2>&1
echo "$(date -u +%FT%TZ) done" | tee -a "$OUT/logs/phases.log"
