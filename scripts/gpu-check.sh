#!/usr/bin/env bash
# Run the GPU tests (marker `gpu`) and the CUDA engine benchmark on a GPU machine.
#
# Usage (repository root, with the project importable, e.g. PYTHONPATH=$PWD):
#   LMC_REQUIRE_GPU=1 bash scripts/gpu-check.sh
# Logs go to $OUT (the device tool's output folder) or ./.bench/gpu-check otherwise:
#   env.txt         GPUs, driver, versions
#   bench.log       the two benchmarks (run first, so their numbers come back early)
#   engine.json     engine store/retrieve GB/s (wall time of the engine call, plus a
#                   host/GPU breakdown) of 1/16/64-chunk DSV4.1 batches, both copy
#                   modes, and the raw pinned copy of the same bytes
#   server.json     the same through a real server: wall time of the client's
#                   store/retrieve calls (what a worker waits for)
#   pytest.log      every other GPU test; junit.xml its per-test results
# Speed is reported, never asserted. Exits non-zero if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/.bench/gpu-check}"
mkdir -p "$out"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/cupy}" PYTHONUNBUFFERED=1 LMC_BENCH_OUT="$out"
export LMC_REQUIRE_GPU="${LMC_REQUIRE_GPU:-1}"

{
  date -u
  nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used \
    --format=csv 2>&1 || true
  python3 -c 'import sys, torch, cupy, numpy; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count()); print("cupy", cupy.__version__, "numpy", numpy.__version__)' 2>&1
} > "$out/env.txt"
cat "$out/env.txt"

timeout_opt=()
python3 -c 'import pytest_timeout' 2>/dev/null && timeout_opt=(--timeout 300)
bench=(tests/gpu/test_cuda_engine.py::test_engine_benchmark
       tests/gpu/test_cuda_server.py::test_server_benchmark)
python3 -m pytest -p no:cacheprovider -v -s "${timeout_opt[@]}" \
  --junitxml="$out/junit-bench.xml" "${bench[@]}" 2>&1 | tee "$out/bench.log"
bench_status=${PIPESTATUS[0]}
deselect=()
for t in "${bench[@]}"; do deselect+=(--deselect "$t"); done
python3 -m pytest -p no:cacheprovider -v -s --durations=15 "${timeout_opt[@]}" \
  --junitxml="$out/junit.xml" tests/gpu "${deselect[@]}" "$@" 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}
nvidia-smi --query-gpu=index,memory.used --format=csv >> "$out/env.txt" 2>&1 || true
[ "$bench_status" -ne 0 ] && [ "$status" -eq 0 ] && status=$bench_status
exit "$status"
