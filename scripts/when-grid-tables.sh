#!/usr/bin/env bash
# Rebuild issue 28's tables (docs/results-cpu/when/) from the grid's finished cells, with this checkout's code:
#
#   bash scripts/when-grid-tables.sh /path/to/pinned-worktree/runs/cpu-minilm-when [ARCHIVE.csv]
#
# The finished run folders (those with a summary.json) are linked into a scratch folder, so the live output folder
# of a running grid is not touched and cells under way are left out; cells of ARCHIVE (default: the committed
# docs/results-cpu/when/results.csv, i.e. every cell finished before, whose run folders may be gone with an earlier
# machine) and the benchmark's own cells count as done. The tables are then rebuilt from the new results.csv alone and
# must come out byte-identical; the code_version of every new run folder is printed. Copies results.csv, results.md,
# budget.png and the grid's logs/phases.log into docs/results-cpu/when/.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:?usage: bash scripts/when-grid-tables.sh RUNS_DIR [ARCHIVE.csv]}
ARCHIVE=${2:-docs/results-cpu/when/results.csv}
PRISMDP=${PRISMDP:-.venv/bin/prismdp}
CONFIG=configs/cpu-minilm-when.yaml
BENCH=docs/results-cpu/benchmark/results.csv
T=$(mktemp -d); R=$(mktemp -d); KEPT=$(mktemp)
trap 'rm -rf "$T" "$R" "$KEPT"' EXIT
cp "$ARCHIVE" "$KEPT"  # the archive may be the file this script overwrites
for d in "$RUNS"/*/; do
  if [ -f "$d/summary.json" ]; then ln -s "$(cd "$d" && pwd)" "$T/$(basename "$d")"; fi
done
"$PRISMDP" experiment "$CONFIG" --output "$T" --results-from "$BENCH" --results-from "$KEPT" --tables-only > /dev/null
"$PRISMDP" experiment "$CONFIG" --output "$R" --results-from "$BENCH" --results-from "$T/results.csv" --tables-only \
  > /dev/null
for f in results.csv results.md budget.png; do
  cmp "$T/$f" "$R/$f" || { echo "rebuild from results.csv differs: $f" >&2; exit 1; }
done
echo "tables rebuilt byte for byte from the new results.csv"
echo "finished run folders here: $(find "$T" -mindepth 1 -maxdepth 1 -type l | wc -l)"
for c in "$T"/*/config.json; do
  if [ -f "$c" ]; then grep -o '"code_version": *"[^"]*"' "$c" || echo "no code_version: $c"; fi
done | sort | uniq -c
cp "$T/results.csv" "$T/results.md" "$T/budget.png" docs/results-cpu/when/
if [ -f "$RUNS/logs/phases.log" ]; then cp "$RUNS/logs/phases.log" docs/results-cpu/when/phases.log; fi
echo "cells in results.csv: $(tail -n +2 docs/results-cpu/when/results.csv | cut -d, -f1 | sort -u | wc -l)"
