#!/usr/bin/env bash
# One device call of the KV-layout work: `bash scripts/gpu-layouts-run.sh STEP` on the
# GPU machine, from the tree, with the wheels installed (docs/gpu.md). STEP:
#   measure  scripts/gpu-dma-layouts.py beside the idle GPU and the HBM-bound engine,
#            then the engine and plan GPU tests;
#   tests    the engine GPU tests of the Llama-like layouts' copy-engine paths, the
#            2-D batch self-check and auto's idle choice.
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
if [ "$step" = tests ]; then
  timeout 80 python3 -m pytest -p no:cacheprovider -q -rA tests/gpu/test_cuda_engine.py -k \
    "(llama and (dma or auto)) or batch_copies or (auto-idle and dsv41-sm90-pad0)" \
    > "$out/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -40
fi
