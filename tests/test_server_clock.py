"""The server's clock decides what settle and the tiers below L1 decide by time, and the
L2 prefetch commits a prefix as a store does: from its last chunk to its first.

In process (:func:`~lmc_server.testing.inprocess.run_server`) with a
:class:`~lmc_server.testing.inprocess.FakeClock`: a store waiting for another writer
gives up when the test moves the clock past the settle timeout, and a remembered L2
miss is forgotten when the clock moves past its memory, without real waiting.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, Registration, chunk_digests
from lmc_server.l2.prefetch import MISS_MEMORY_S
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import encode
from lmc_server.server.settle import SETTLE_TIMEOUT_S
from lmc_server.testing.engines import HoldingEngine
from lmc_server.testing.inprocess import FakeClock, run_server
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.presets import simple_model
from lmc_server.testing.redis_process import RedisProcess, redis_server_path
from lmc_server.testing.tierworker import wait_for

CHUNK = 256


def digests_of(seed: int, chunks: int) -> bytes:
    return chunk_digests(np.random.default_rng(seed).integers(0, 100_000, chunks * CHUNK),
                         CHUNK)


def wire_ids(reg: Registration, ids: dict[str, np.ndarray]) -> list[bytes]:
    return [ids[g.name].astype("<i4").tobytes() if g.cached else b"" for g in reg.groups]


def test_a_store_waiting_for_another_writer_gives_up_by_the_servers_clock() -> None:
    """The winner's copy is held; the loser waits to settle. Moving the fake clock past
    the settle timeout ends the wait at the next housekeeping tick: the loser hears
    ``IN_PROGRESS`` (another store is still copying), and the server serves on."""
    clock, engine = FakeClock(), HoldingEngine()
    with ShmKV(simple_model()) as kv, run_server(engine=engine, clock=clock) as ts, \
            Client(ts.endpoint) as writer, Client(ts.endpoint) as loser:
        kv.fill_random(3)
        reg_w = writer.register(**kv.register_kwargs())
        reg_l = loser.register(**kv.register_kwargs())  # same namespace, same keys
        digests = digests_of(1, 1)
        ids = block_ids_for(reg_w, 1)
        try:
            writer.send_raw([encode(m.Store(req_id=10, registration_id=reg_w.registration_id,
                                            digests=digests, block_ids=wire_ids(reg_w, ids)))])
            engine.wait_held()
            loser.send_raw([encode(m.Store(req_id=11, registration_id=reg_l.registration_id,
                                           digests=digests, block_ids=wire_ids(reg_l, ids)))])
            for req_id in (12, 13):  # the second is read after the store's task ran
                loser.send_raw([encode(m.Ping(req_id=req_id))])
                reply = loser.recv_reply(10)
                assert isinstance(reply, m.Pong) and reply.req_id == req_id, reply
            clock.advance(SETTLE_TIMEOUT_S + 1)
            reply = loser.recv_reply(5)  # no real waiting for the 10 s timeout
            assert isinstance(reply, m.StoreResult) and reply.req_id == 11, reply
            assert set(reply.statuses[0]) == {ChunkStatus.IN_PROGRESS}, reply.statuses
        finally:
            engine.release()
        reply = writer.recv_reply(10)
        assert isinstance(reply, m.StoreResult) and set(reply.statuses[0]) == {ChunkStatus.OK}
        assert loser.lookup(reg_l, digests, lease=False).hit_chunks == 1  # serves on


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    pytest.importorskip("redis")
    with RedisProcess() as r:
        yield r


def test_a_remembered_l2_miss_is_forgotten_by_the_servers_clock(
        redis_proc: RedisProcess) -> None:
    """Server B looks a prefix up before server A stored it: L2 misses, and B remembers
    the miss for ``MISS_MEMORY_S`` of its clock (a poll starts no L2 read). Once A's
    copy is in L2, B still reports nothing pending until the test moves B's clock past
    the memory; then the next lookup fetches it."""
    clock = FakeClock()
    fields = {"l2_url": redis_proc.url, "l2_timeout_s": 0.5}
    with ShmKV(simple_model()) as kv, run_server(**fields) as a, \
            run_server(clock=clock, **fields) as b, \
            Client(a.endpoint) as ca, Client(b.endpoint) as cb:
        kv.fill_random(4)
        reg_a, reg_b = ca.register(**kv.register_kwargs()), cb.register(**kv.register_kwargs())
        for c in (ca, cb):
            wait_for(lambda c=c: c.stats().l2.state == "up", "L2 connected")
        digests = digests_of(2, 2)

        def pending() -> int:
            return cb.lookup(reg_b, digests, lease=False).l2_pending_chunks

        assert pending() == 2  # a prefetch starts, and misses
        wait_for(lambda: pending() == 0 and cb.stats().l2.misses >= 1, "B's miss")
        assert ca.store(reg_a, digests, block_ids_for(reg_a, 2)).ok.all()
        wait_for(lambda: ca.stats().l2.objects_written >= 2, "A's objects in L2")
        assert pending() == 0  # remembered: no L2 read, whatever the real time
        clock.advance(MISS_MEMORY_S + 0.5)
        assert pending() == 2  # forgotten: fetching
        wait_for(lambda: cb.lookup(reg_b, digests, lease=False).hit_chunks == 2, "B's hit")


def test_an_l2_prefetch_commits_a_prefix_from_its_last_chunk_to_its_first(
        tmp_path: Path) -> None:
    """docs/architecture.md: chunk 0, which every longer hit needs, is evicted last. A
    prefix brought back from the disk tier, then one object too many stored under FIFO
    (commit order is the eviction order): the prefix's last chunk goes, its first three
    still hit. (Committed first to last, chunk 0 went and the prefix hit nothing.)"""
    n = 4
    with ShmKV(simple_model()) as kv, \
            run_server(eviction_policy="FIFO", l1_size_gb=0.0625, slab_size_mb=16,
                       disk_dir=str(tmp_path), disk_size_gb=0.25) as ts, \
            Client(ts.endpoint) as c:
        kv.fill_random(5)
        reg = c.register(**kv.register_kwargs())
        wait_for(lambda: c.stats().l1.ready_slabs == c.stats().l1.slabs, "pool ready")
        prefix = digests_of(3, n)
        ids = block_ids_for(reg, n)
        assert c.store(reg, prefix, ids).ok.all()
        wait_for(lambda: c.stats().disk.objects_written >= n
                 and c.stats().disk.writes_in_flight == 0, "the prefix on disk")
        assert c.clear() == n
        wait_for(lambda: c.lookup(reg, prefix, lease=False).hit_chunks == n, "prefetched")
        st = c.stats()
        (part,) = st.partitions
        capacity = st.l1.slabs * (st.l1.slab_bytes // part.object_bytes)
        assert st.counters.evictions == 0
        fill, seed = capacity - n + 1, 100
        while fill:
            k = min(n, fill)
            assert c.store(reg, digests_of(seed, k), block_ids_for(reg, k)).ok.all()
            fill, seed = fill - k, seed + 1
        assert c.stats().counters.evictions == 1
        assert c.lookup(reg, prefix, lease=False).hit_chunks == n - 1
