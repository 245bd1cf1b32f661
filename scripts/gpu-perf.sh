#!/usr/bin/env bash
# The GPU machine's performance measurements of docs/benchmarks.md in one go.
#
# Usage (repository root, project importable, e.g. PYTHONPATH=$PWD, on a GPU machine):
#   bash scripts/gpu-perf.sh [throughput|ranks|dp|latency|l2|all]   (default: all)
# Writes under $OUT (the device tool's output folder) or ./.bench/gpu-perf:
#   throughput.json  bench throughput (staging)
#   spy-server.txt   py-spy raw stacks of the server process during the first throughput
#                    run (when py-spy is installed; 250 Hz, non-blocking)
#   ranks-1gpu.json  bench ranks, 8 ranks on GPU 0 (TP load and mixed phases)
#   ranks-all.json   bench ranks, 8 ranks round-robin over every visible GPU
#   ranks-dp-1gpu.json / .png   bench ranks --mode dp, 8 independent engines on GPU 0
#   ranks-dp-all.json / .png    the same, engines round-robin over every visible GPU
#   latency.json     bench latency (control path vs a pyzmq echo)
#   l2.json          bench l2 (the L2 tier vs redis-py on the same bytes; needs
#                    redis-server on PATH, e.g. carried: scripts/carry-redis.sh)
#   l2-c4.json, l2-c8.json, l2-c8-io4.json   the same with 4 and 8 connections, and
#                    8 connections to a redis-server with 4 I/O threads
# Speed is reported, never asserted; the commands exit non-zero only on wrong bytes or
# failed checks.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/.bench/gpu-perf}"
mkdir -p "$out"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/cupy}" PYTHONUNBUFFERED=1
what="${1:-all}"
status=0
bench() { python3 -m lmc_server bench "$@" 2>&1 | grep -v ' INFO ' ; }

if [ "$what" = all ] || [ "$what" = throughput ]; then
  tp=(throughput --backend cuda --batches 1,16,64 --inflight 1,2 --cuda-copy-mode staging
      --min-time-s 0.3 --no-progress)
  bench "${tp[@]}" --json "$out/throughput.json" > "$out/throughput.log" &
  pid=$!
  if command -v py-spy >/dev/null; then
    for _ in $(seq 200); do
      srv=$(pgrep -f 'lmc_server server' | head -1)
      [ -n "$srv" ] && break
      sleep 0.1
    done
    sleep 2
    [ -n "${srv:-}" ] && py-spy record -p "$srv" -r 250 -d 25 -f raw --nonblocking \
      -o "$out/spy-server.txt" >/dev/null 2>&1
  fi
  wait $pid || status=1
  cat "$out/throughput.log"
fi
if [ "$what" = all ] || [ "$what" = ranks ]; then
  rk=(ranks --backend cuda --ranks 8 --chunks 256 --batch 16 --duration-s 5 --no-kill-one
      --tp-s 5 --tp-chunks 64 --raw-s 0.5)
  CUDA_VISIBLE_DEVICES=0 bench "${rk[@]}" --json "$out/ranks-1gpu.json" || status=1
  bench "${rk[@]}" --json "$out/ranks-all.json" || status=1
fi
if [ "$what" = all ] || [ "$what" = dp ]; then
  dp=(ranks --mode dp --backend cuda --ranks 8 --chunks 256 --batch 64 --duration-s 10
      --no-kill-one --raw-s 0.5 --l1-size-gb 32)
  CUDA_VISIBLE_DEVICES=0 bench "${dp[@]}" --json "$out/ranks-dp-1gpu.json" \
    --plot "$out/ranks-dp-1gpu.png" || status=1
  bench "${dp[@]}" --json "$out/ranks-dp-all.json" --plot "$out/ranks-dp-all.png" || status=1
fi
if [ "$what" = all ] || [ "$what" = latency ]; then
  bench latency --duration-s 1 --no-progress --json "$out/latency.json" || status=1
fi
if [ "$what" = all ] || [ "$what" = l2 ]; then
  bench l2 --rounds 5 --repeats 7 --json "$out/l2.json" || status=1
  bench l2 --chunks 256 --l1-size-gb 4 --rounds 3 --repeats 3 --latency-chunks 16 \
    --json "$out/l2-256.json" || status=1
  # Connections, and redis-server's I/O threads (Redis 7 uses them only while at least
  # twice as many clients have replies pending: 8 connections for 4 threads).
  for c in 4 8; do
    bench l2 --rounds 3 --repeats 5 --l2-connections $c --json "$out/l2-c$c.json" || status=1
  done
  bench l2 --rounds 3 --repeats 5 --l2-connections 8 --redis-io-threads 4 \
    --json "$out/l2-c8-io4.json" || status=1
fi
exit $status
