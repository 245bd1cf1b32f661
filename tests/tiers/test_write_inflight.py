"""How many write batches the write-behind keeps in flight, and that a slow one does not
hold the rest.

A backend that writes from the slots gets ``SLOT_BATCHES_IN_FLIGHT`` batches per shard
of it (a cluster's primaries; one for a single store) before the writer waits, and the
writer goes on as soon as any batch is written, not only the oldest: a cluster's
batch ends with its most loaded node, and waiting for the oldest made every node wait
for that one. Checked in process with a backend whose first write does not return
until the test lets it: the other batches keep going, never more than the bound are in
flight, and once the first returns every object is written and nothing stays pinned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from lmc_server.testing.l1 import MIB, dsv_view, ids_for, make_index
from lmc_server.tiers import codec, writer
from lmc_server.tiers.backend import L2Backend, SlotObject, Value
from lmc_server.tiers.context import TierContext
from lmc_server.tiers.poolview import PoolView
from lmc_server.tiers.stats import L2Stats
from lmc_server.tiers.writer import SLOT_BATCHES_IN_FLIGHT, WriteBehind

NS = "model=x;kv_dtype=fp8;arch=sm90;world=1;rank=replicated"
CHUNKS = 60
BATCH_OBJECTS = 4


class Pool:
    """The bytes behind a :func:`make_index` pool (what :class:`PoolView` reads)."""

    def __init__(self, pool_mib: int, slab_mib: int) -> None:
        self.array = np.zeros(pool_mib * MIB, dtype=np.uint8)
        self.slab_bytes = slab_mib * MIB


class HeldStore(L2Backend):
    """Writes from the slots; its first write returns only once ``first`` is set, the
    others after a moment. Counts the writes in flight."""

    name = "held"
    writes_from_slots = True

    def __init__(self, shards: int) -> None:
        self._shards = shards
        self.first = asyncio.Event()
        self.started = self.finished = self.running = self.peak = 0
        self.running_while_first_held: list[int] = []
        self.written: list[bytes] = []

    @property
    def write_shards(self) -> int:
        return self._shards

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        return [None] * len(keys)

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        raise AssertionError("a backend that writes from the slots gets put_slots")

    async def put_slots(self, objects: Sequence[SlotObject]) -> None:
        n = self.started
        self.started += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        if not self.first.is_set():
            self.running_while_first_held.append(self.running)
        try:
            if n == 0:
                await self.first.wait()
            else:
                await asyncio.sleep(0.001)
            self.written.extend(o.key for o in objects)
        finally:
            self.running -= 1
            self.finished += 1


@pytest.mark.parametrize("shards", [1, 3])
def test_batches_in_flight_per_shard_and_none_waits_for_the_oldest(
    monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    monkeypatch.setattr(writer, "WRITE_BATCH_OBJECTS", BATCH_OBJECTS)
    index = make_index(pool_mib=32, slab_mib=4)
    view = dsv_view(index, layers=2)
    pool = Pool(32, 4)
    stats = L2Stats()
    objects = 2 * CHUNKS  # two object groups
    limit = SLOT_BATCHES_IN_FLIGHT * shards
    assert objects // BATCH_OBJECTS > limit + 10, "enough batches to pass the bound"

    async def main() -> HeldStore:
        store = HeldStore(shards)
        with ThreadPoolExecutor(2) as executor:
            ctx = TierContext(
                index,
                store,
                stats,
                PoolView(pool, "cpu"),  # type: ignore[arg-type]  # array and slab_bytes
                executor,
                lambda ns, fp: codec.space_of(ns, fp, 256),
                lambda: True,
                lambda e: None,
            )
            wb = WriteBehind(ctx, max_objects=4 * objects)
            wb.start()
            keys = [(1).to_bytes(4, "little") + bytes([i]) * 32 for i in range(CHUNKS)]
            ticket = index.reserve_store(view, keys, ids_for(view, CHUNKS))
            index.commit_store(ticket)
            wb.enqueue(NS, ticket)
            wb.wake()
            batches = objects // BATCH_OBJECTS
            for _ in range(2000):  # every batch but the held one is written meanwhile
                if store.finished >= batches - 1:
                    break
                await asyncio.sleep(0.002)
            assert store.finished == batches - 1, (
                f"{store.finished} of {batches - 1} batches written behind a slow one"
            )
            assert not store.first.is_set() and store.running == 1
            store.first.set()
            await wb.drain(10.0)
            await wb.stop(1.0)
        return store

    store = asyncio.run(main())
    assert store.peak == limit, f"{store.peak} batches in flight at most, not {limit}"
    assert max(store.running_while_first_held) == limit
    assert len(store.written) == len(set(store.written)) == objects
    assert stats.objects_written == objects and not stats.dropped_writes
    for part in view._partitions:
        assert not any(part.pins), "a slot was left pinned"
    index.check()
