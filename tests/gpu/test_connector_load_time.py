"""GPU time of a connector hit: from the scheduler's decision to the loaded blocks being
ready (the worker reports ``finished_recving``), for hits of 1, 16 and 64 chunks, over
GPU memory exported as CUDA IPC handles and a CUDA-engine server; every load checked
byte-exact (:mod:`lmc_server.testing.connector_timing`; CPU twin in
``tests/integration/test_connector_runtime.py``).

A Llama-3-8B-like cache (32 layers, 4 KiB per token per layer: 128 KiB per token), so a
64-chunk hit moves 2 GiB. The figures are printed and, with ``LMC_BENCH_JSON=PATH``,
written there; nothing is asserted about them:

    LMC_REQUIRE_GPU=1 LMC_BENCH_JSON=$OUT/load-time.json \\
        pytest tests/gpu/test_connector_load_time.py -s -q
"""

from __future__ import annotations

import json
import os

import pytest

from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.gpu

SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
CHUNKS = (1, 16, 64)


def test_load_time_from_decision_to_blocks_ready() -> None:
    from lmc_server.client.cuda import stream_done
    from lmc_server.testing.connector_timing import blocks_needed, load_times
    from lmc_server.testing.cuda_kv import CudaKV, device_arch
    from lmc_server.testing.presets import simple_model

    geo = simple_model(
        arch=device_arch(0), num_blocks=blocks_needed(CHUNKS), layers=32, bytes_per_token=4096
    )
    with (
        ServerProcess(SERVER_ARGS, backend="cuda", l1_size_gb=6, start_timeout_s=60) as srv,
        CudaKV(geo) as kv,
    ):
        srv.wait_pool_ready()
        kv.fill_random(23)
        res = load_times(srv.endpoint, kv, CHUNKS, repeats=10, ready=stream_done())
    for n, r in res.items():
        mib = n * 256 * 32 * 4096 / 2**20
        print(
            f"hit of {n:2} chunks ({mib:6.0f} MiB): decision to blocks ready "
            f"median {1e3 * r['median_s']:.2f} ms, max {1e3 * r['max_s']:.2f} ms, "
            f"{mib / 1024 / r['median_s']:.1f} GiB/s"
        )
    if os.environ.get("LMC_BENCH_JSON"):
        with open(os.environ["LMC_BENCH_JSON"], "w") as f:
            json.dump({str(n): r for n, r in res.items()}, f, indent=1)
    assert set(res) == set(CHUNKS)
