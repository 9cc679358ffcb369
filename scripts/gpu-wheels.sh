#!/usr/bin/env bash
# Run HERE (a machine with PyPI access), in the repository root: downloads into .whl/ (git-ignored through
# .git/info/exclude) the wheels prismdp needs beyond the GPU image of this workplace's device machines (Python 3.12,
# torch, transformers, peft, numpy, scipy, attrs, absl-py, mpmath, opt-einsum, wrapt already there; no network
# there). About 50 MB; the working tree and the wheels travel together (64 MiB at most). Then, on the device:
#   run(command="bash scripts/gpu-check.sh", carry=[".whl"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for pkg in "opacus>=1.5" "dp-accounting>=0.4" "dm-tree" "randomgen>=2.0" "torchao>=0.18" "bitsandbytes>=0.50"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$pkg"
done
du -sh .whl
