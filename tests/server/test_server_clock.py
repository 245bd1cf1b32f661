"""The server's clock decides what settle and the tiers below L1 decide by time.

In process (:func:`~lmc_server.testing.inprocess.run_server`) with a
:class:`~lmc_server.testing.inprocess.FakeClock`: a store waiting for another writer
gives up when the test moves the clock past the settle timeout, and a remembered L2
miss is forgotten when the clock moves past its memory, without real waiting.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, Registration, chunk_digests
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import encode
from lmc_server.protocol.stats import L2Report
from lmc_server.server.settle import SETTLE_TIMEOUT_S
from lmc_server.testing.engines import HoldingEngine
from lmc_server.testing.inprocess import FakeClock, run_server
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.presets import simple_model
from lmc_server.testing.redis_process import RedisProcess
from lmc_server.testing.tierworker import wait_for
from lmc_server.tiers.prefetch import MISS_MEMORY_S

CHUNK = 256


def l2_of(c: Client) -> L2Report:
    l2 = c.stats().l2
    assert l2 is not None, "the server runs without an L2 tier"
    return l2


def digests_of(seed: int, chunks: int) -> bytes:
    return chunk_digests(np.random.default_rng(seed).integers(0, 100_000, chunks * CHUNK), CHUNK)


def wire_ids(reg: Registration, ids: dict[str, np.ndarray]) -> list[bytes]:
    return [ids[g.name].astype("<i4").tobytes() if g.cached else b"" for g in reg.groups]


def test_a_store_waiting_for_another_writer_gives_up_by_the_servers_clock() -> None:
    """The winner's copy is held; the loser waits to settle. Moving the fake clock past
    the settle timeout ends the wait at the next housekeeping tick: the loser hears
    ``IN_PROGRESS`` (another store is still copying), and the server serves on."""
    clock, engine = FakeClock(), HoldingEngine()
    with (
        ShmKV(simple_model()) as kv,
        run_server(engine=engine, clock=clock) as ts,
        Client(ts.endpoint) as writer,
        Client(ts.endpoint) as loser,
    ):
        kv.fill_random(3)
        reg_w = writer.register(**kv.register_kwargs())
        reg_l = loser.register(**kv.register_kwargs())  # same namespace, same keys
        digests = digests_of(1, 1)
        ids = block_ids_for(reg_w, 1)
        try:
            writer.send_raw(
                [
                    encode(
                        m.Store(
                            req_id=10,
                            registration_id=reg_w.registration_id,
                            digests=digests,
                            block_ids=wire_ids(reg_w, ids),
                        )
                    )
                ]
            )
            engine.wait_held()
            loser.send_raw(
                [
                    encode(
                        m.Store(
                            req_id=11,
                            registration_id=reg_l.registration_id,
                            digests=digests,
                            block_ids=wire_ids(reg_l, ids),
                        )
                    )
                ]
            )
            loser.send_raw([encode(m.Ping(req_id=12))])
            reply = loser.recv_reply(10)  # read after the store
            assert isinstance(reply, m.Pong) and reply.req_id == 12, reply
            answer: m.Reply | None = None
            for _ in range(20):  # 5 s at most: half the settle timeout, in real seconds
                # (the store's task may not be waiting yet: then move the clock again)
                clock.advance(SETTLE_TIMEOUT_S + 1)
                try:
                    answer = loser.recv_reply(0.25)
                    break
                except TimeoutError:
                    continue
            assert isinstance(answer, m.StoreResult) and answer.req_id == 11, answer
            assert set(answer.statuses[0]) == {ChunkStatus.IN_PROGRESS}, answer.statuses
        finally:
            engine.release()
        reply = writer.recv_reply(10)
        assert isinstance(reply, m.StoreResult) and set(reply.statuses[0]) == {ChunkStatus.OK}
        assert loser.lookup(reg_l, digests, lease=False).hit_chunks == 1  # serves on


@pytest.mark.needs_tool("redis-server", "Debian: redis-server; CI: .ci/install-redis.sh")
def test_a_remembered_l2_miss_is_forgotten_by_the_servers_clock(redis_proc: RedisProcess) -> None:
    """Server B looks a prefix up before server A stored it: L2 misses, and B remembers
    the miss for ``MISS_MEMORY_S`` of its clock (a poll starts no L2 read). Once A's
    copy is in L2, B still reports nothing pending until the test moves B's clock past
    the memory; then the next lookup fetches it."""
    clock = FakeClock()
    fields: dict[str, Any] = {"l2_url": redis_proc.url, "l2_timeout_s": 0.5}
    with (
        ShmKV(simple_model()) as kv,
        run_server(**fields) as a,
        run_server(clock=clock, **fields) as b,
        Client(a.endpoint) as ca,
        Client(b.endpoint) as cb,
    ):
        kv.fill_random(4)
        reg_a, reg_b = ca.register(**kv.register_kwargs()), cb.register(**kv.register_kwargs())
        for c in (ca, cb):
            wait_for(lambda c=c: l2_of(c).state == "up", "L2 connected")  # type: ignore[misc]
        digests = digests_of(2, 2)

        def pending() -> int:
            return cb.lookup(reg_b, digests, lease=False).l2_pending_chunks

        assert pending() == 2  # a prefetch starts, and misses
        wait_for(lambda: pending() == 0 and l2_of(cb).misses >= 1, "B's miss")
        assert ca.store(reg_a, digests, block_ids_for(reg_a, 2)).ok.all()
        wait_for(lambda: l2_of(ca).objects_written >= 2, "A's objects in L2")
        assert pending() == 0  # remembered: no L2 read, whatever the real time
        clock.advance(MISS_MEMORY_S + 0.5)
        assert pending() == 2  # forgotten: fetching
        wait_for(lambda: cb.lookup(reg_b, digests, lease=False).hit_chunks == 2, "B's hit")
