"""The connector's links and worker through a real server restart, on the CUDA engine.

The GPU twin of ``tests/integration/test_connector_restart.py``: the connector's scheduler and
worker parts (:class:`lmc_server.testing.connector_flow.ConnectorFlow`) over one real
CUDA allocation laid out as vLLM 0.33 lays out its KV cache (the fixtures), exported as
CUDA IPC handles, against a CUDA-engine server restarted between turns (SIGTERM),
killed -9 and started again, or killed and started again only after the next turn
arrived. The next turn's stores succeed on the new server (the worker's IPC handles are
opened again by the new process) and the turn after loads them byte-exact; nothing is
left in /dev/shm.

Run on a GPU machine (``scripts/gpu-check.sh``); skipped elsewhere, failed when
``LMC_REQUIRE_GPU=1`` finds no GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmc_server.testing.kvfixture import KVFixture
from lmc_server.testing.server_restarts import HOW, RestartingServer

pytestmark = pytest.mark.gpu

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
SEED = 19


def prompt(salt: int) -> list[int]:
    return [salt * 100_000 + i for i in range(2 * 256 + 60)]


@pytest.fixture
def servers() -> Iterator[RestartingServer]:
    # 0.25 GiB: four slabs, pinned well before a turn's store reaches a new server
    s = RestartingServer(SERVER_ARGS, backend="cuda", l1_size_gb=0.25, start_timeout_s=60)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("kind", ["dsv41", "llama"])
def test_the_connector_stores_and_loads_after_a_restart_on_gpu(
    servers: RestartingServer, kind: str, how: str
) -> None:
    from lmc_server.integration.exporters import CudaExporter
    from lmc_server.testing.connector_flow import ConnectorFlow
    from lmc_server.testing.cuda_backing import CudaBacking
    from lmc_server.testing.cuda_kv import device_arch

    sm100 = device_arch(0) == "sm100"
    name = {"dsv41": "vllm-dsv41-sm100" if sm100 else "vllm-dsv41-sm90", "llama": "vllm-llama"}
    fx = KVFixture.load(FIXTURES / f"{name[kind]}.json")
    with (
        CudaBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(
            fx, mem, servers.endpoint, device_arch(0), exporter=CudaExporter(), timeout_s=30
        ) as flow,
    ):
        flow.check_survives_restart(SEED, prompt(4), lambda: servers.restart(how))
    servers.close()
    assert len(servers.pids) == 2
    mine = tuple(f"lmc-{p}-" for p in [os.getpid(), *servers.pids])
    assert [n for n in os.listdir("/dev/shm") if n.startswith(mine)] == []
