"""Eviction and leases through a live server with a pool of eight 1 MiB objects.

The server runs in process (nothing here needs a process); lease expiry reads its fake
clock, so no test waits for a TTL in real time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, Registration, chunk_digests
from lmc_server.client.aio import AsyncClient
from lmc_server.protocol import messages as m
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.inprocess import FakeClock, ThreadServer, run_server
from lmc_server.testing.kv import block_ids_for

SLOTS = 8


@pytest.fixture(scope="module")
def tiny() -> Iterator[ThreadServer]:
    """Leases of 1 s on a clock that stands still: they hold however slow the machine."""
    with run_server(
        clock=FakeClock(),
        l1_size_gb=SLOTS / 1024,
        slab_size_mb=1,
        lease_ttl_s=1.0,
        eviction_policy="LRU",
    ) as ts:
        yield ts


@pytest.fixture
def setup(tiny: ThreadServer) -> Iterator[tuple[Client, Registration, ShmKV]]:
    with Client(tiny.endpoint) as c, ShmKV(simple_model(layers=4, bytes_per_token=1024)) as kv:
        kv.fill_random(3)
        c.clear()
        reg = c.register(**kv.register_kwargs())
        assert reg.chunk_bytes == 1 << 20
        yield c, reg, kv


def one_chunk(i: int) -> bytes:
    return chunk_digests(np.full(256, i), 256)


def present(c: Client, reg: Registration, n: int) -> list[int]:
    return [i for i in range(n) if c.lookup(reg, one_chunk(i), lease=False).hit_chunks]


def test_lru_order_under_a_small_pool(setup: tuple[Client, Registration, ShmKV]) -> None:
    c, reg, _ = setup
    ids = block_ids_for(reg, 1)
    for i in range(SLOTS):
        assert c.store(reg, one_chunk(i), ids).ok.all()
    assert c.lookup(reg, one_chunk(0), lease=False).hit_chunks == 1  # 0 becomes recent
    for i in (SLOTS, SLOTS + 1):
        assert c.store(reg, one_chunk(i), ids).ok.all()
    # 1 and 2 were least recently used; checking presence touches, so check once
    assert present(c, reg, SLOTS + 2) == [0, 3, 4, 5, 6, 7, 8, 9]
    stats = c.stats()
    assert stats.counters.evictions >= 2
    assert stats.l1.objects == SLOTS


def test_leased_chunk_survives_pressure_until_released(
    setup: tuple[Client, Registration, ShmKV],
) -> None:
    c, reg, kv = setup
    ids = block_ids_for(reg, 1)
    assert c.store(reg, one_chunk(100), ids).ok.all()
    lease = c.lookup(reg, one_chunk(100))
    assert lease.hit_chunks == 1 and lease.lease_id
    for i in range(3 * SLOTS):
        c.store(reg, one_chunk(200 + i), ids)
    # still there: the retrieve the lease promised delivers the right bytes
    other = block_ids_for(reg, 1, first_block=16)
    assert c.retrieve(reg, one_chunk(100), other).ok.all()
    assert kv.pages("full", ids["full"].tolist()) == kv.pages("full", other["full"].tolist())
    assert c.release(lease.lease_id)
    assert not c.release(lease.lease_id)
    for i in range(SLOTS):
        c.store(reg, one_chunk(300 + i), ids)
    assert c.lookup(reg, one_chunk(100), lease=False).hit_chunks == 0


def test_lease_expires_after_its_ttl() -> None:
    """In process with a fake clock: the lease holds until the clock passes its TTL and
    a housekeeping tick runs; then it is gone and its chunk is evictable again."""
    clock = FakeClock()
    with (
        run_server(
            clock=clock,
            l1_size_gb=SLOTS / 1024,
            slab_size_mb=1,
            lease_ttl_s=1.0,
            eviction_policy="LRU",
        ) as ts,
        Client(ts.endpoint) as c,
        ShmKV(simple_model(layers=4, bytes_per_token=1024)) as kv,
    ):
        kv.fill_random(3)
        reg = c.register(**kv.register_kwargs())
        ids = block_ids_for(reg, 1)
        assert c.store(reg, one_chunk(400), ids).ok.all()
        lease = c.lookup(reg, one_chunk(400))
        assert lease.lease_ttl_s == 1.0 and lease.hit_chunks == 1
        clock.advance(0.9)  # not yet: ticks run, the lease holds
        ts.wait_housekeeping()
        assert c.stats().counters.leases_expired == 0
        clock.advance(0.7)
        ts.wait_housekeeping()
        assert c.stats().counters.leases_expired == 1
        assert not c.release(lease.lease_id)
        for i in range(SLOTS):
            assert c.store(reg, one_chunk(500 + i), ids).ok.all()
        assert c.lookup(reg, one_chunk(400), lease=False).hit_chunks == 0


def test_everything_leased_means_no_space_per_chunk(
    setup: tuple[Client, Registration, ShmKV],
) -> None:
    c, reg, _ = setup
    ids = block_ids_for(reg, 1)
    leases = []
    for i in range(SLOTS):
        assert c.store(reg, one_chunk(600 + i), ids).ok.all()
        leases.append(c.lookup(reg, one_chunk(600 + i)).lease_id)
    failures = c.stats().counters.alloc_failures.get("no_space", 0)
    res = c.store(reg, one_chunk(700), ids)
    assert [st.tolist() for st in res.statuses.values()] == [[ChunkStatus.NO_SPACE]]
    assert res.failed_chunks == [0]
    assert c.stats().counters.alloc_failures["no_space"] == failures + 1
    assert present(c, reg, 0) == [] and all(
        c.lookup(reg, one_chunk(600 + i), lease=False).hit_chunks for i in range(SLOTS)
    )
    for lease_id in leases:
        assert c.release(lease_id)
    assert c.store(reg, one_chunk(700), ids).ok.all()


def test_async_client_runs_requests_concurrently(tiny: ThreadServer) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(tiny.endpoint) as c:
            with ShmKV(simple_model(layers=1, bytes_per_token=256)) as kv:
                kv.fill_random(9)
                reg = await c.register(**kv.register_kwargs())
                digests = [chunk_digests(np.full(256, 1000 + i), 256) for i in range(4)]
                stores = await asyncio.gather(
                    *(c.store(reg, d, block_ids_for(reg, 1)) for d in digests)
                )
                assert all(r.ok.all() for r in stores), [r.statuses for r in stores]
                looks = await asyncio.gather(
                    *(c.lookup(reg, d, lease=False) for d in digests), c.ping()
                )
                assert [x.hit_chunks for x in looks[:4] if isinstance(x, m.LookupResult)] == [
                    1,
                    1,
                    1,
                    1,
                ]

    asyncio.run(main())
