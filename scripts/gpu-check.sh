#!/usr/bin/env bash
# Run ON THE GPU HOST, in the repository root (see scripts/gpu-wheels.sh for the wheels it installs when .whl/ is
# there): the paths not yet run on a GPU (python -m bench.gpu_paths, a random-init SmolLM2-shaped model: nothing to
# download), a profile of the benchmark's variants (python -m bench.gpu_profile: kernel time and launches), then the
# GPU benchmark (python -m bench.gpu) in the time left, all within about 9 minutes. Results go to
# $OUT (the device tool's folder) or bench/results.
#   PARTS=profile,qr,bench bash scripts/gpu-check.sh   # other parts, in this order: paths (bench.gpu_paths),
#                                                      # qr (bench.studies.gpu_qr, ~10 s), loss (bench.gpu_loss, ~1 min),
#                                                      # profile (bench.gpu_profile, ~1 min: wall minus kernel
#                                                      # time, CUDA syncs per variant), secure (bench.studies.secure_noise
#                                                      # on the host's cores, ~1 min), bench (bench.gpu, the time
#                                                      # left, extra arguments in BENCH_ARGS, default: the
#                                                      # variants issue 44 measures);
#                                                      # default PARTS=paths,profile,secure,bench; TOTAL=540 (s)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-bench/results}
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$OUTDIR/gpu-check-nvidia-smi.txt"
PARTS=",${PARTS:-paths,profile,secure,bench},"
start=$(date +%s)
paths=0
if [[ $PARTS == *,paths,* ]]; then
  timeout 300 $PY -m bench.gpu_paths --model random --output "$OUTDIR" 2>&1 | tee "$OUTDIR/gpu-paths.log"
  paths=${PIPESTATUS[0]}
fi
if [[ $PARTS == *,qr,* ]]; then
  timeout 60 $PY -m bench.studies.gpu_qr --output "$OUTDIR" 2>&1 | tail -20
fi
if [[ $PARTS == *,loss,* ]]; then
  timeout 150 $PY -m bench.gpu_loss --output "$OUTDIR" 2>&1 | tail -12
fi
if [[ $PARTS == *,profile,* ]]; then
  timeout 150 $PY -m bench.gpu_profile --output "$OUTDIR" 2>&1 | grep "^\[gpu_profile\]"
fi
if [[ $PARTS == *,secure,* ]]; then
  timeout 120 $PY -m bench.studies.secure_noise --workloads llama-3.2-1b-r16 --methods prism --rounds 5 \
    --threads "$(( $(nproc) > 8 ? 8 : $(nproc) ))" --output "$OUTDIR/secure-noise" 2>&1 | tail -6
fi
left=$(( ${TOTAL:-540} - ($(date +%s) - start) ))
if [[ $PARTS == *,bench,* ]] && [ "$left" -gt 120 ]; then
  timeout "$left" $PY -m bench.gpu --time-budget $(( left - 90 )) \
    ${BENCH_ARGS:---variants reference,no-dp,dp-adamw,prism,prism-dropout,prism-tf32-products,prism-bf16-products,prism-secure} \
    --output "$OUTDIR" 2>&1 | tail -40 | tee "$OUTDIR/gpu-bench.log"
fi
echo "gpu_paths exit code (failed checks): $paths"
exit "$paths"
