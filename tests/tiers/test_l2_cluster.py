"""L2 on a Redis Cluster: real redis-server nodes on loopback, real servers, real bytes.

A three-node cluster (primaries only, ``redis-cli --cluster create``) behind
``--l2 redis+cluster://...``: what server A stores, server B reads back byte for byte,
with the keys spread over every node; a node killed mid-run makes the tier degraded
(lookups that miss L1 are misses, stores and L1 hits go on, nothing wrong served) and
it comes back by itself; slots migrated with their keys while B reads (MOVED and ASK
followed by redis-py's cluster client) cost no error and no wrong byte. The adapter
alone: every node's share moves on that node's own connections, all nodes at once; a
node killed mid-read fails the call as unavailable, never a wrong byte.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmc_server.client import chunk_digests
from lmc_server.testing.bench_runs import run_bench_l2
from lmc_server.testing.redis_cluster import RedisClusterProcess
from lmc_server.testing.tierworker import (
    CHUNK,
    Worker,
    l2_server,
    l2_stats,
    lookup_until,
    retrieve_exact,
    tokens,
    wait_for,
    wait_l2_written,
)
from lmc_server.tiers import codec
from lmc_server.tiers.backend import L2Error, SlotObject, SlotRead
from lmc_server.tiers.redis import reads as redis_reads
from lmc_server.tiers.redis.cluster import RedisClusterBackend

pytestmark = [
    pytest.mark.needs_tool("redis-server", "Debian: redis-server; CI: .ci/install-redis.sh"),
    pytest.mark.needs_tool("redis-cli", "Debian: redis-tools; CI: .ci/install-redis.sh"),
]


@pytest.fixture
def cluster() -> Iterator[RedisClusterProcess]:
    with RedisClusterProcess(3) as c:
        yield c


def up(w: Worker) -> bool:
    return l2_stats(w.client).state == "up"


def test_store_on_a_read_on_b_across_the_nodes(cluster: RedisClusterProcess) -> None:
    with l2_server(cluster.url) as a, l2_server(cluster.url) as b:
        src, dst = Worker(a.endpoint, seed=11), Worker(b.endpoint, seed=0)
        try:
            wait_for(lambda: up(src) and up(dst), "both connected")
            stored = []
            for p in range(3):
                d = chunk_digests(tokens(600 + p, 4), CHUNK)
                stored.append((d, src.store(d, block_seed=p)))
            wait_l2_written(src.client, 3 * 4 * 2)
            assert all(n.client().dbsize() > 0 for n in cluster.nodes), "keys on every node"
            for d, ids in stored:
                retrieve_exact(dst, src, ids, d, 4)
            st = l2_stats(dst.client)
            assert st.hits >= 3 * 4 * 2 and not st.invalid and not st.errors
        finally:
            src.close()
            dst.close()


def test_a_node_killed_mid_run_costs_misses_then_comes_back(
    cluster: RedisClusterProcess,
) -> None:
    with l2_server(cluster.url) as a, l2_server(cluster.url) as b:
        src, dst = Worker(a.endpoint, seed=12), Worker(b.endpoint, seed=0)
        try:
            wait_for(lambda: up(src) and up(dst), "both connected")
            d0 = chunk_digests(tokens(700, 4), CHUNK)
            ids0 = src.store(d0, block_seed=1)
            wait_l2_written(src.client, 8)
            cluster.stop_node(1)
            for p in range(3):  # stores and L1 go on; L2 writes fail or are dropped
                src.store(chunk_digests(tokens(710 + p, 4), CHUNK), block_seed=p)
            assert src.client.lookup(src.reg, d0, lease=False).hit_chunks == 4
            wait_for(lambda: not up(dst) or not up(src), "a tier degraded", 30)
            miss = chunk_digests(tokens(799, 4), CHUNK)
            r = dst.client.lookup(dst.reg, miss, lease=False)
            assert r.hit_chunks == 0  # a miss, not an error
            cluster.start_node(1)
            cluster.wait_ok()
            wait_for(lambda: up(src) and up(dst), "both back up", 30)
            d1 = chunk_digests(tokens(720, 4), CHUNK)
            ids1 = src.store(d1, block_seed=9)
            written = l2_stats(src.client).objects_written
            wait_for(lambda: l2_stats(src.client).objects_written >= written, "writes")
            wait_l2_written(src.client, written)
            retrieve_exact(dst, src, ids1, d1, 4)
            # What the killed node held is gone (it came back empty): a miss or the
            # exact bytes, never anything else.
            dst.client.clear()
            hit = lookup_until(dst.client, dst.reg, d0, 0).hit_chunks
            dst.client.release(dst.client.lookup(dst.reg, d0).lease_id)
            if hit:
                retrieve_exact(dst, src, ids0, d0, hit)
            assert not l2_stats(dst.client).invalid
            assert "Traceback" not in a.log() + b.log()
        finally:
            src.close()
            dst.close()


def test_slots_migrated_while_reading_cost_no_error_and_no_wrong_byte(
    cluster: RedisClusterProcess,
) -> None:
    with l2_server(cluster.url) as a, l2_server(cluster.url) as b:
        src, dst = Worker(a.endpoint, seed=13), Worker(b.endpoint, seed=0)
        try:
            wait_for(lambda: up(src) and up(dst), "both connected")
            stored = []
            for p in range(4):
                d = chunk_digests(tokens(800 + p, 4), CHUNK)
                stored.append((d, src.store(d, block_seed=p)))
            wait_l2_written(src.client, 4 * 4 * 2)
            keys_before = cluster.keys()
            moved: list[str] = []
            errors: list[BaseException] = []

            def reshard() -> None:
                try:
                    moved.append(cluster.move_slots(0, 1, 3000))
                except BaseException as e:  # reported below
                    errors.append(e)

            t = threading.Thread(target=reshard)
            t.start()
            rounds = 0
            while t.is_alive() or rounds < 2:
                for d, ids in stored:
                    dst.client.clear()
                    look = lookup_until(dst.client, dst.reg, d, 0)
                    dst.client.release(look.lease_id)
                    r = dst.client.lookup(dst.reg, d, lease=False)
                    if r.hit_chunks:
                        retrieve_exact(dst, src, ids, d, r.hit_chunks)
                rounds += 1
            t.join()
            assert not errors, errors
            assert cluster.keys() == keys_before  # the keys moved, none lost
            wait_for(lambda: up(dst), "up after the migration", 30)
            for d, ids in stored:  # every prompt, through the new slot map
                dst.client.clear()
                retrieve_exact(dst, src, ids, d, 4)
            st = l2_stats(dst.client)
            assert not st.invalid
            assert "Traceback" not in a.log() + b.log()
        finally:
            src.close()
            dst.close()


def test_bench_l2_starts_a_cluster_and_reads_back_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    report, _ = run_bench_l2(
        out, "--redis-cluster-nodes", "3", "--warm-store-gb", "0.01", latency_chunks="1"
    )
    assert report["config"]["redis_cluster_nodes"] == 3
    assert report["summary"]["mismatched_groups"] == 0 and report["summary"]["retrieved_ok"]


def _slot_objects(
    backend: RedisClusterBackend, n: int, seed: int
) -> tuple[list[SlotObject], list[SlotRead], np.ndarray, np.ndarray]:
    """``n`` objects of 64 KiB under keys spread over the nodes: to write (from ``src``)
    and to read back (into ``dst``)."""
    size = 64 << 10
    src = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    objects, reads = [], []
    for i in range(n):
        ck = b"%032d" % (seed * 10_000 + i)
        key = codec.l2_key(SPACE, ck)
        part = slice(i * size, (i + 1) * size)
        objects.append(SlotObject(key, SPACE, ck, 3, src[part].data))
        reads.append(SlotRead(key, SPACE, ck, 3, dst[part].data))
    return objects, reads, src, dst


SPACE = codec.space_of("model=x;kv_dtype=fp8;arch=sm90;world=1;rank=0", b"c" * 16, 256)


def test_each_node_has_its_own_connections_and_the_nodes_move_side_by_side(
    cluster: RedisClusterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One read of keys on every node: each node's share runs on that node's own
    ``--l2-connections`` threads (here 2), all at once: 3 nodes x 2 parts in flight
    together, not 2 parts in all queued over the nodes."""
    running: dict[int, int] = {}
    most: dict[int, int] = {}
    threads: dict[int, set[str]] = {}
    lock = threading.Lock()
    read_values = redis_reads.read_values

    def slow_read(conn: Any, reads: Any) -> Any:
        port = conn.port
        with lock:
            running[port] = running.get(port, 0) + 1
            most[port] = max(most.get(port, 0), running[port])
            threads.setdefault(port, set()).add(threading.current_thread().name)
            together = sum(running.values())
            most[0] = max(most.get(0, 0), together)
        time.sleep(0.3)  # long enough for every part to start meanwhile
        try:
            return read_values(conn, reads)
        finally:
            with lock:
                running[port] -= 1

    async def main() -> None:
        backend = RedisClusterBackend(cluster.url, timeout_s=5, connections=2)
        assert backend.write_shards == len(cluster.nodes)  # the URL's, before the map
        await backend.connect()
        try:
            # the primaries of the slot map: the writer keeps batches in flight per node
            assert backend.write_shards == 3
            objects, reads, src, dst = _slot_objects(backend, 24, 1)
            await backend.put_slots(objects)
            monkeypatch.setattr(redis_reads, "read_values", slow_read)
            t0 = time.monotonic()
            assert await backend.get_into(reads) == [True] * len(reads)
            took = time.monotonic() - t0
            assert (dst == src).all()
        finally:
            await backend.shutdown()
        ports = [n.port for n in cluster.nodes]
        assert all(most.get(p) == 2 for p in ports), most  # 2 parts per node at once
        assert most[0] == 6, most  # every node's parts in flight together
        assert len(set().union(*threads.values())) == 6, threads  # threads of its own
        assert took < 2 * 0.3, took  # one round of parts, not three

    asyncio.run(main())


def test_a_node_stopped_mid_read_fails_the_call_as_unavailable_never_a_wrong_byte(
    cluster: RedisClusterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node killed while its share is being read: the call raises ``unavailable``
    (the tier goes degraded: misses, the prefetch aborts every slot of the batch) once
    every node's threads are done, within the socket timeout, and reports nothing as
    read that was not. The other nodes' reads finish on their own threads."""
    victim = cluster.nodes[1].port
    started = threading.Event()
    read_values = redis_reads.read_values

    def read(conn: Any, reads: Any) -> Any:
        if conn.port == victim:
            started.set()
            time.sleep(0.3)  # the node is killed meanwhile
        return read_values(conn, reads)

    async def main() -> None:
        backend = RedisClusterBackend(cluster.url, timeout_s=2, connections=2)
        await backend.connect()
        try:
            objects, reads, src, dst = _slot_objects(backend, 24, 2)
            await backend.put_slots(objects)
            monkeypatch.setattr(redis_reads, "read_values", read)
            call = asyncio.ensure_future(backend.get_into(reads))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
            cluster.stop_node(1)
            t0 = time.monotonic()
            with pytest.raises(L2Error) as e:
                await call
            assert e.value.unavailable
            assert time.monotonic() - t0 < 2 + 1
            cluster.start_node(1)
            cluster.wait_ok()
            # Back up (the node came back empty): its keys are misses, the others' exact.
            await backend.connect()
            monkeypatch.setattr(redis_reads, "read_values", read_values)
            dst[:] = 0
            got = await backend.get_into(reads)
            size = len(reads[0].dest)
            for i, (r, res) in enumerate(zip(reads, got, strict=True)):
                assert res is True or res is None, res
                cl = backend._client
                on_victim = cl.nodes_manager.get_node_from_slot(cl.keyslot(r.key)).port == victim
                assert (res is None) == on_victim, (i, res)
                if res is True:
                    assert (dst[i * size : (i + 1) * size] == src[i * size : (i + 1) * size]).all()
        finally:
            await backend.shutdown()

    asyncio.run(main())
