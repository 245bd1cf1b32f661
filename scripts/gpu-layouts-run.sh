#!/usr/bin/env bash
# One device call of the KV-layout work: `bash scripts/gpu-layouts-run.sh STEP` on the
# GPU machine, from the tree, with the wheels installed (docs/gpu.md). STEP:
#   measure  scripts/gpu-dma-layouts.py beside the idle GPU and the HBM-bound engine,
#            then the engine and plan GPU tests;
#   bench    `lmcache bench interference` for every layout in the default copy mode,
#            `bench throughput` on the idle GPU, then the server GPU tests.
# Logs and JSON go to $OUT.
set -uo pipefail
out="${OUT:-$PWD/.bench/layouts}"
mkdir -p "$out"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/cupy}" PYTHONUNBUFFERED=1 LMC_REQUIRE_GPU=1
step="${1:-measure}"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > "$out/gpu.txt" 2>&1
if [ "$step" = measure ]; then
  timeout 150 python3 scripts/gpu-dma-layouts.py --seconds 0.25 --engines idle,hbm \
    --methods raw,cur,b1,b4,b8 --json "$out/dma-layouts.json" > "$out/dma-layouts.log" 2>&1
  echo "dma-layouts rc=$?"
  timeout 150 python3 -m pytest -p no:cacheprovider -q -k "not benchmark" \
    tests/gpu/test_cuda_plan.py tests/gpu/test_cuda_engine.py > "$out/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "passed|failed|error" "$out/tests.log" | tail -15
  tail -75 "$out/dma-layouts.log"
fi
