#!/usr/bin/env bash
# Rebuild a grid's committed tables from its finished cells, with this checkout's code (the one script behind
# when-grid-tables.sh and decoder-grid-tables.sh):
#
#   bash scripts/grid-tables.sh CONFIG DOCS_DIR RUNS_DIR [ARCHIVE.csv]
#   FILES="results.csv results.md budget.png" FIXED=docs/results-cpu/benchmark/results.csv bash scripts/grid-tables.sh ...
#
# The finished run folders of RUNS_DIR (those with a summary.json) are linked into a scratch folder, so the live
# output folder of a running grid is not touched and cells under way are left out; cells of ARCHIVE (default:
# DOCS_DIR/results.csv, when there is one: cells finished before, whose run folders may be gone with an earlier
# machine) and of FIXED (results.csv files read as they are, e.g. another grid's cells) count as done. The tables are
# then rebuilt from the new results.csv alone and must come out byte-identical; the code_version of every new run
# folder is printed. Copies FILES (default: results.csv results.md) and the grid's logs/phases.log into DOCS_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?usage: bash scripts/grid-tables.sh CONFIG DOCS_DIR RUNS_DIR [ARCHIVE.csv]}
DOCS=${2:?usage: bash scripts/grid-tables.sh CONFIG DOCS_DIR RUNS_DIR [ARCHIVE.csv]}
RUNS=${3:?usage: bash scripts/grid-tables.sh CONFIG DOCS_DIR RUNS_DIR [ARCHIVE.csv]}
ARCHIVE=${4:-$DOCS/results.csv}
FILES=${FILES:-results.csv results.md}
PRISMDP=${PRISMDP:-.venv/bin/prismdp}
FROM=(); for f in ${FIXED:-}; do FROM+=(--results-from "$f"); done
T=$(mktemp -d); R=$(mktemp -d); KEPT=$(mktemp)
trap 'rm -rf "$T" "$R" "$KEPT"' EXIT
KEEP=()
if [ -f "$ARCHIVE" ]; then cp "$ARCHIVE" "$KEPT"; KEEP=(--results-from "$KEPT"); fi  # ARCHIVE may be overwritten
for d in "$RUNS"/*/; do
  if [ -f "$d/summary.json" ]; then ln -s "$(cd "$d" && pwd)" "$T/$(basename "$d")"; fi
done
"$PRISMDP" experiment "$CONFIG" --output "$T" "${FROM[@]}" "${KEEP[@]}" --tables-only > /dev/null
"$PRISMDP" experiment "$CONFIG" --output "$R" "${FROM[@]}" --results-from "$T/results.csv" --tables-only > /dev/null
for f in $FILES; do
  cmp "$T/$f" "$R/$f" || { echo "rebuild from results.csv differs: $f" >&2; exit 1; }
done
echo "tables rebuilt byte for byte from the new results.csv"
echo "finished run folders here: $(find "$T" -mindepth 1 -maxdepth 1 -type l | wc -l)"
for c in "$T"/*/config.json; do
  if [ -f "$c" ]; then grep -o '"code_version": *"[^"]*"' "$c" || echo "no code_version: $c"; fi
done | sort | uniq -c
mkdir -p "$DOCS"
for f in $FILES; do cp "$T/$f" "$DOCS/"; done
if [ -f "$RUNS/logs/phases.log" ]; then cp "$RUNS/logs/phases.log" "$DOCS/phases.log"; fi
echo "cells in results.csv: $(tail -n +2 "$DOCS/results.csv" | cut -d, -f1 | sort -u | wc -l)"
