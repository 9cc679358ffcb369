#!/usr/bin/env bash
# Issue 45 item 2: what honest tuning does to the PRISM vs DP-AdamW comparison, on the benchmark's SST-2 and MNLI
# settings (configs/cpu-minilm-benchmark.yaml), total epsilon 3 and 8, seeds 42-44, paired:
#   (a) honest: `prismdp tune` (docs/tuning.md) over the benchmark's four rates, the per-trial noise calibrated so
#       that the whole tuning (every trial, the noisy val scores and the choice) meets epsilon. TRIALS=grid (default):
#       each rate once, the four trials composed (PRV): the cheapest honest choice for four short trials, 4 runs per
#       tuning, 96 runs. TRIALS=geometric:4: Papernot-Steinke's random count; --tune-seed = --seed, so PRISM and
#       DP-AdamW of one seed face the same K and the same drawn rates (seeds 42, 43, 44 draw K = 9, 4, 3: 16 trials
#       per (task, method, epsilon), 128 runs). The output folder is named after TRIALS;
#   (b) no tuning: configs/cpu-minilm-notune.yaml, the README's starting rates, the whole budget in one run (24 runs);
#   (c) free tuning: already measured (docs/results-cpu/benchmark for epsilon 3, docs/results-cpu/when for 8).
# Two single-thread processes; rerunning continues where it stopped (`prismdp tune --resume` keeps each tuning's
# saved draw; the grid skips finished cells). Run it from a worktree pinned to one commit.
#
#   bash scripts/honest-grid.sh [OUT]        # default OUT: runs/cpu-minilm-honest
#   TRIALS=geometric:4 bash scripts/honest-grid.sh   # the random count instead of the grid
#   NICE=19 bash scripts/honest-grid.sh      # lower priority (share the machine)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu-minilm-honest}
PRISMDP=${PRISMDP:-.venv/bin/prismdp}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/logs"

# the benchmark's base (configs/cpu-minilm-benchmark.yaml) and per-task settings
DATA=${DATA:-../shared/data/glue}  # the shared GLUE data, from the repository root
BASE=(--pooling mean --head-lr 2e-2 --data "$DATA" --holdout-val 1000 --rank 16 --alpha 16
      --dropout 0.05 --target-modules query,key,value --batch-size 128 --micro-batch-size 32 --max-grad-norm 1.0
      --delta 1e-5 --accountant prv --eval-batch-size 128 --checkpoint-every 20)
declare -A TASK=([sst2]="--task sst2 --steps 80 --max-length 64"
                 [mnli]="--task mnli --steps 40 --max-length 128 --eval-splits validation_matched")
LRS=3e-4,1e-3,3e-3,1e-2
TRIALS=${TRIALS:-grid}

jobs_list() {  # one line per tuning: task method epsilon seed
  for eps in 3 8; do for task in sst2 mnli; do for seed in 42 43 44; do for method in prism dp-adamw; do
    echo "$task $method $eps $seed"
  done; done; done; done
}

worker() {  # worker K N: every N-th tuning from the K-th
  local k=$1 n=$2 i=0
  while read -r task method eps seed; do
    i=$((i + 1))
    (( (i - 1) % n == k )) || continue
    local name="${task}__${method}__eps${eps}__seed${seed}__${TRIALS//:/-}"
    local mk=()
    [ "$method" = prism ] && mk=(--method-kwargs "{preset: paper}")
    echo "$(date -u +%FT%TZ) tune $name" >> "$OUT/logs/honest-$k.log"
    nice -n "${NICE:-0}" $PRISMDP tune "${BASE[@]}" ${TASK[$task]} --method "$method" "${mk[@]}" --epsilon "$eps" \
      --seed "$seed" --tune-seed "$seed" --lrs "$LRS" --trials "$TRIALS" --output "$OUT/$name" --resume --quiet \
      >> "$OUT/logs/honest-$k.log" 2>&1 || echo "$(date -u +%FT%TZ) FAILED $name" >> "$OUT/logs/honest-$k.log"
  done < <(jobs_list)
}

echo "$(date -u +%FT%TZ) honest tuning (a): 24 tunings, --trials $TRIALS" | tee -a "$OUT/logs/phases.log"
worker 0 2 & worker 1 2 & wait
echo "$(date -u +%FT%TZ) no tuning (b): configs/cpu-minilm-notune.yaml" | tee -a "$OUT/logs/phases.log"
for p in a b; do
  nice -n "${NICE:-0}" $PRISMDP experiment configs/cpu-minilm-notune.yaml --output "$OUT/notune" --quiet \
    >> "$OUT/logs/notune-$p.log" 2>&1 &
done
wait
echo "$(date -u +%FT%TZ) done" | tee -a "$OUT/logs/phases.log"
