#!/usr/bin/env bash
# Rebuild issue 45's decoder tables (docs/results-cpu/decoder/) from the grid's finished cells, with this checkout's
# code:
#
#   bash scripts/decoder-grid-tables.sh /path/to/pinned-worktree/runs/cpu-smollm2-glue [ARCHIVE.csv]
#
# The finished run folders (those with a summary.json) are linked into a scratch folder, so the live output folder
# of a running grid is not touched and cells under way are left out; cells of ARCHIVE (default: the committed
# docs/results-cpu/decoder/results.csv, when there is one: cells finished before, whose run folders may be gone with
# an earlier machine) count as done. The tables are then rebuilt from the new results.csv alone and must come out
# byte-identical; the code_version of every new run folder is printed. Copies results.csv, results.md and the grid's
# logs/phases.log into docs/results-cpu/decoder/.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:?usage: bash scripts/decoder-grid-tables.sh RUNS_DIR [ARCHIVE.csv]}
DOCS=docs/results-cpu/decoder
ARCHIVE=${2:-$DOCS/results.csv}
PRISMDP=${PRISMDP:-.venv/bin/prismdp}
CONFIG=configs/cpu-smollm2-glue.yaml
T=$(mktemp -d); R=$(mktemp -d); KEPT=$(mktemp)
trap 'rm -rf "$T" "$R" "$KEPT"' EXIT
KEEP=()
if [ -f "$ARCHIVE" ]; then cp "$ARCHIVE" "$KEPT"; KEEP=(--results-from "$KEPT"); fi  # ARCHIVE may be overwritten
for d in "$RUNS"/*/; do
  if [ -f "$d/summary.json" ]; then ln -s "$(cd "$d" && pwd)" "$T/$(basename "$d")"; fi
done
"$PRISMDP" experiment "$CONFIG" --output "$T" "${KEEP[@]}" --tables-only > /dev/null
"$PRISMDP" experiment "$CONFIG" --output "$R" --results-from "$T/results.csv" --tables-only > /dev/null
for f in results.csv results.md; do
  cmp "$T/$f" "$R/$f" || { echo "rebuild from results.csv differs: $f" >&2; exit 1; }
done
echo "tables rebuilt byte for byte from the new results.csv"
echo "finished run folders here: $(find "$T" -mindepth 1 -maxdepth 1 -type l | wc -l)"
for c in "$T"/*/config.json; do
  if [ -f "$c" ]; then grep -o '"code_version": *"[^"]*"' "$c" || echo "no code_version: $c"; fi
done | sort | uniq -c
mkdir -p "$DOCS"
cp "$T/results.csv" "$T/results.md" "$DOCS/"
if [ -f "$RUNS/logs/phases.log" ]; then cp "$RUNS/logs/phases.log" "$DOCS/phases.log"; fi
echo "cells in results.csv: $(tail -n +2 "$DOCS/results.csv" | cut -d, -f1 | sort -u | wc -l)"
