"""The vLLM connector's worker path on a GPU, over KV caches exactly as vLLM 0.33
allocates them.

The fixtures (``tests/fixtures/vllm-*.json``) were made from vLLM's own classes by
``scripts/vllm-kv-fixture.py`` (vLLM cannot be installed on the GPU machine). Here the
backing allocation is one real CUDA tensor with every layer view rebuilt over it at the
fixture's shape, strides, dtype and offset (layers of different groups overlaying one
allocation, as vLLM places them); the registration is derived by the same vLLM-free
code the connector runs (``lmc_server.integration.kvlayout``), exported as CUDA IPC
handles, and driven through the connector's planner, worker transfers and link
(:class:`lmc_server.testing.connector_flow.ConnectorFlow`) against a real server on
the CUDA engine. Stores wait on ``stream_done`` of the stream that wrote the pages.
``tests/integration/test_connector_fixtures.py`` is the CPU twin that runs in CI.

Run on a GPU machine (``scripts/gpu-check.sh``); skipped elsewhere, failed when
``LMC_REQUIRE_GPU=1`` finds no GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmc_server.client import ServerError
from lmc_server.testing.kvfixture import KVFixture
from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.gpu

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
WORKER = Path(__file__).with_name("connector_worker.py")
SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
SEED = 11


def fixture(kind: str) -> KVFixture:
    """``dsv41``: the fixture of this device's record format; ``dsv41-other``: the
    other one; ``llama``: the plain model."""
    from lmc_server.testing.cuda_kv import device_arch

    sm100 = device_arch(0) == "sm100"
    names = {
        "dsv41": "vllm-dsv41-sm100" if sm100 else "vllm-dsv41-sm90",
        "dsv41-other": "vllm-dsv41-sm90" if sm100 else "vllm-dsv41-sm100",
        "llama": "vllm-llama",
    }
    return KVFixture.load(FIXTURES / f"{names[kind]}.json")


def prompt(salt: int) -> list[int]:
    """Two whole 256-token chunks and a tail: a hit is 512 tokens."""
    return [salt * 100_000 + i for i in range(2 * 256 + 60)]


@pytest.fixture(scope="module")
def cuda_server() -> Iterator[ServerProcess]:
    with ServerProcess(SERVER_ARGS, backend="cuda", l1_size_gb=1, start_timeout_s=60) as srv:
        srv.wait_pool_ready()  # stores right after start must not meet unpinned slabs
        yield srv


@pytest.mark.parametrize("kind", ["dsv41", "llama"])
def test_store_then_load_byte_exact_on_gpu(cuda_server: ServerProcess, kind: str) -> None:
    """The derivation over real CUDA tensors equals the one over vLLM's allocation;
    stores leave GPU memory alone; a hit loaded into other blocks writes exactly the
    stored pages of every cached group and layer and nothing else (the scratch rings
    that overlay the same allocation keep their bytes, and get no block ids)."""
    from lmc_server.buffers import CudaIpcBuffer
    from lmc_server.integration.exporters import CudaExporter
    from lmc_server.testing.connector_flow import ConnectorFlow
    from lmc_server.testing.cuda_backing import CudaBacking
    from lmc_server.testing.cuda_kv import device_arch

    fx = fixture(kind)
    with (
        CudaBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(
            fx, mem, cuda_server.endpoint, device_arch(0), exporter=CudaExporter()
        ) as flow,
    ):
        assert flow.plan.groups == fx.groups
        assert len(flow.plan.buffers) == 1 and isinstance(flow.plan.buffers[0], CudaIpcBuffer)
        flow.check_store_then_load(SEED, prompt(1))


@pytest.mark.parametrize("kind", ["dsv41", "llama"])
def test_failed_load_is_reported_not_success_on_gpu(cuda_server: ServerProcess, kind: str) -> None:
    """Chunks never stored: reported failed (block ids with one full-attention group, the
    request with several, as vLLM 0.33 requires), never as success; no byte changes."""
    from lmc_server.integration.exporters import CudaExporter
    from lmc_server.testing.connector_flow import ConnectorFlow
    from lmc_server.testing.cuda_backing import CudaBacking
    from lmc_server.testing.cuda_kv import device_arch

    fx = fixture(kind)
    with (
        CudaBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(
            fx, mem, cuda_server.endpoint, device_arch(0), exporter=CudaExporter()
        ) as flow,
    ):
        flow.check_failed_load(SEED + 1, prompt(2))


def test_other_arch_records_refused(cuda_server: ServerProcess) -> None:
    """The other arch's DeepSeek-V4.1 records, registered from this device, are refused."""
    from lmc_server.integration.exporters import CudaExporter
    from lmc_server.testing.connector_flow import ConnectorFlow
    from lmc_server.testing.cuda_backing import CudaBacking
    from lmc_server.testing.cuda_kv import device_arch

    fx = fixture("dsv41-other")
    with CudaBacking(fx.backing_size_bytes) as mem:
        with pytest.raises(ServerError) as e:
            ConnectorFlow(fx, mem, cuda_server.endpoint, device_arch(0), exporter=CudaExporter())
        assert e.value.code == "arch"


def test_second_worker_process_loads_replicated_kv(cuda_server: ServerProcess) -> None:
    """Replicated (MLA) KV stored by rank 0 here is loaded byte-exact by rank 1 in
    another process, into its own GPU memory (same seed, so the same bytes)."""
    from lmc_server.integration.exporters import CudaExporter
    from lmc_server.testing.connector_flow import ConnectorFlow
    from lmc_server.testing.cuda_backing import CudaBacking
    from lmc_server.testing.cuda_kv import device_arch

    fx = fixture("dsv41")
    assert fx.replicated
    tokens = prompt(3)
    with (
        CudaBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(
            fx,
            mem,
            cuda_server.endpoint,
            device_arch(0),
            exporter=CudaExporter(),
            rank=0,
            world_size=2,
        ) as flow,
    ):
        mem.fill_random(SEED + 2)
        a = flow.tables(len(tokens))
        _, rep = flow.prefill("A", tokens, a)
        assert rep.finished_sending == {"A"} and flow.tracker.failed_store_chunks == 0
        args = {
            "endpoint": cuda_server.endpoint,
            "fixture": str(FIXTURES / f"{fx.name}.json"),
            "seed": SEED + 2,
            "tokens": [tokens[0], len(tokens)],
            "rank": 1,
            "world_size": 2,
        }
        p = subprocess.run(
            [sys.executable, str(WORKER), json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ),
        )
    assert p.returncode == 0, f"worker failed:\n{p.stdout}\n{p.stderr}"
    assert "LOAD OK" in p.stdout


def test_batched_step_of_many_requests_on_gpu(cuda_server: ServerProcess) -> None:
    """120 requests store in one step and 120 hit in one step, on GPU memory exported
    as IPC handles: one batched store and batched retrieves of at most
    ``LOAD_PART_CHUNKS`` chunks, no ``busy``, every
    load byte-exact (the CPU twin: tests/integration/test_connector_runtime.py)."""
    from lmc_server.client.cuda import stream_done
    from lmc_server.testing.connector_flow import check_batched_step
    from lmc_server.testing.cuda_kv import CudaKV, device_arch
    from lmc_server.testing.presets import simple_model

    n = 120
    geo = simple_model(arch=device_arch(0), num_blocks=34 * n + 8, layers=4)
    with CudaKV(geo) as kv:
        kv.fill_random(SEED + 3)
        check_batched_step(cuda_server.endpoint, kv, n, ready=stream_done())
