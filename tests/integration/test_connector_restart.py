"""The connector's links and worker through a real server restart, on the CPU engine.

The CPU twin of ``tests/gpu/test_connector_restart_gpu.py``: the connector's scheduler
and worker parts (:class:`lmc_server.testing.connector_flow.ConnectorFlow`) over a KV
cache exactly as vLLM 0.33 allocates it (``tests/fixtures/vllm-*.json``) in shared
memory, against a server that is restarted between turns (SIGTERM), killed -9 and
started again, or killed and started again only after the next turn arrived. In every
case the next turn's stores succeed on the new server and the turn after loads them
byte-exact (:meth:`ConnectorFlow.check_survives_restart`), and nothing is left in
/dev/shm by this process or any server.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmc_server.client import Client
from lmc_server.testing.connector_flow import ConnectorFlow
from lmc_server.testing.engines import UnpreparedPoolEngine
from lmc_server.testing.kvfixture import KVFixture, ShmBacking
from lmc_server.testing.server_restarts import HOW, RestartingServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
SEED = 17


def prompt(salt: int) -> list[int]:
    return [salt * 100_000 + i for i in range(2 * 256 + 60)]


@pytest.fixture
def servers() -> Iterator[RestartingServer]:
    s = RestartingServer(SERVER_ARGS, l1_size_gb=0.25)
    try:
        yield s
    finally:
        s.close()


def left_in_dev_shm(pids: list[int]) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(tuple(f"lmc-{p}-" for p in pids))]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", ["vllm-dsv41-sm90", "vllm-llama"])
def test_the_connector_stores_and_loads_after_a_restart(
    servers: RestartingServer, name: str, how: str
) -> None:
    fx = KVFixture.load(FIXTURES / f"{name}.json")
    restart: Callable[[], None] = lambda: servers.restart(how)  # noqa: E731
    with (
        ShmBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(fx, mem, servers.endpoint, fx.arch or "cpu", timeout_s=15) as flow,
    ):
        assert left_in_dev_shm([os.getpid(), *servers.pids]) == []
        flow.check_survives_restart(SEED, prompt(3), restart)
    servers.close()
    assert len(servers.pids) == 2
    assert left_in_dev_shm([os.getpid(), *servers.pids]) == []


def store_then_load_while_busy(
    c: Client,
    engine: UnpreparedPoolEngine,
    flow: ConnectorFlow,
    tokens: list[int],
    busy_before: int,
) -> int:
    """Run the flow's store-then-load turn while the server answers its stores ``busy``,
    preparing the whole pool once ``busy_before`` stores were refused so; how many were."""

    def busy_stores() -> int:
        return int(c.stats().counters.requests.get("store:busy", 0))

    def prepare_once_the_link_was_refused() -> None:
        deadline = time.monotonic() + 10
        while busy_stores() < busy_before and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.prepare()

    preparer = threading.Thread(target=prepare_once_the_link_was_refused)
    preparer.start()
    try:
        flow.check_store_then_load(SEED, tokens)
    finally:
        preparer.join()
    return busy_stores()


def test_a_store_that_comes_before_the_pool_is_prepared_waits_for_it() -> None:
    """A server that just started prepares its pool slab by slab (pinning a large one
    takes seconds on CUDA), and clients can register and store before its first slab is
    ready. Such a store is answered ``busy`` (the connector's link asks again), not
    failed: once the pool is ready the turn's chunks are stored, no chunk failed, and
    the next turn loads them byte-exact; a ping is served meanwhile."""
    from lmc_server.client import ServerError
    from lmc_server.client.digests import chunk_digests
    from lmc_server.testing.inprocess import run_server
    from lmc_server.testing.kv import ShmKV, block_ids_for
    from lmc_server.testing.presets import simple_model

    fx = KVFixture.load(FIXTURES / "vllm-llama.json")
    engine = UnpreparedPoolEngine()
    with (
        run_server(engine=engine, ready=False, chunk_size=256) as ts,
        Client(ts.endpoint) as c,
        ShmKV(simple_model()) as kv,
        ShmBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(fx, mem, ts.endpoint, fx.arch or "cpu", timeout_s=15) as flow,
    ):
        reg = c.register(**kv.register_kwargs())
        with pytest.raises(ServerError) as refused:
            c.store(reg, chunk_digests(list(range(256)), 256), block_ids_for(reg, 1))
        assert refused.value.code == "busy" and "no slab ready" in str(refused.value)

        busy = store_then_load_while_busy(c, engine, flow, prompt(5), busy_before=2)
        assert busy >= 2, "the link's store never met the unprepared pool"
        assert c.ping().ready


def test_a_store_whose_object_group_has_no_slab_yet_waits_for_it() -> None:
    """With separate object groups each group's partition is handed slabs of its own as
    the pool is prepared, so a server that just started may place one group of a store
    and have no slab for another. Such a store is answered ``busy`` with nothing of it
    kept (no object written or being written), not stored with that group's chunks
    failed: the link asks again until the next slab is ready, the turn's chunks are
    all stored and the next turn loads them byte-exact; other clients are served
    meanwhile."""
    from lmc_server.client import ServerError
    from lmc_server.client.digests import chunk_digests
    from lmc_server.testing.inprocess import run_server
    from lmc_server.testing.kv import ShmKV, block_ids_for
    from lmc_server.testing.poll import wait_for
    from lmc_server.testing.presets import dsv41_flash

    fx = KVFixture.load(FIXTURES / "vllm-dsv41-sm90.json")
    engine = UnpreparedPoolEngine()
    with (
        run_server(engine=engine, ready=False, chunk_size=256, separate_object_groups=True) as ts,
        Client(ts.endpoint) as c,
        ShmKV(dsv41_flash()) as kv,
        ShmBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(fx, mem, ts.endpoint, fx.arch or "cpu", timeout_s=15) as flow,
    ):
        engine.prepare(1)
        wait_for(lambda: c.ping().ready, "the first slab reported ready", 10.0)
        reg = c.register(**kv.register_kwargs())
        with pytest.raises(ServerError) as refused:
            c.store(reg, chunk_digests(list(range(256)), 256), block_ids_for(reg, 1))
        assert refused.value.code == "busy" and "no room ready" in str(refused.value)
        st = c.stats()
        assert st.l1.objects == 0 and sum(p.writing for p in st.partitions) == 0

        busy = store_then_load_while_busy(c, engine, flow, prompt(6), busy_before=3)
        assert busy >= 3, "the link's store never met the partly prepared pool"
        assert c.stats().l1.ready_slabs == c.stats().l1.slabs
