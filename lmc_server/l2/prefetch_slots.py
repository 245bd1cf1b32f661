"""Prefetch into slots: the read path of a backend that receives values into L1 itself.

For a backend with ``reads_into_slots`` (Redis), :class:`~lmc_server.l2.prefetch.Prefetcher`
hands each batch of chunks here instead of reading values and copying them. Per batch:

1. the headers of the objects L1 lacks (:meth:`L2Backend.heads`, one small round
   trip, while the previous batch is still being received), checked on the loop
   (:func:`lmc_server.l2.codec.check_head`): a missing or refused value reserves
   nothing;
2. a WRITING slot per object worth reading, through the index (as a store reserves);
3. the backend receives each value into its slot and verifies header, mask and
   checksum on its threads (:meth:`L2Backend.get_into`, which returns only once no
   thread writes to a slot);
4. the index commits each verified object and aborts every other one, last chunk
   first (:meth:`~lmc_server.cache.index.L1Index.finish_fill`). A slot that got a
   damaged, short or foreign value, or whose read failed, is aborted: never visible.

The outcome and its counters are the ones of the copying path: hits, misses,
``invalid{reason}`` (refused keys go to ``bad`` for deletion, except another format
version's), ``prefetch_no_space``, and the run stops at the first chunk whose full
object group L2 cannot supply.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lmc_server.cache.index import L1Index, Reservation
from lmc_server.cache.view import CacheView
from lmc_server.l2 import codec, settle
from lmc_server.l2.backend import Head, L2Backend, SlotRead, Value
from lmc_server.l2.poolview import PoolView
from lmc_server.l2.stats import L2Stats

#: Batches being received at once (each at most the prefetch's ``READ_BATCH_BYTES`` of
#: reserved slots): 4 of 32 MiB reserve as much L1 as 2 of 64 MiB, and keep a connection
#: that finished its share of one batch busy with the next three (Valkey 8, 4 I/O threads,
#: on the H200 host: reads 2.12-2.23 GB/s with 4 x 32 MiB, 1.69-2.03 with 2 x 64 MiB).
BATCHES_IN_FLIGHT = 4
#: (object group, chunk, mask, value or its header, L2 key) of a value worth reading.
Good = tuple[int, int, int, Value, bytes]


@dataclass(frozen=True, slots=True)
class Filling:
    """WRITING slots of one object group and, per object, the fetched value (or, when
    read into slots, its header) and its L2 key."""

    objects: Reservation
    values: list[Value]
    l2keys: list[bytes]


#: (object group, chunk, L2 namespace, L2 key) of an object a batch lacks in L1.
Wanted = tuple[int, int, bytes, bytes]


def wanted_objects(
    index: L1Index, view: CacheView, keys: list[bytes], spaces: list[bytes], batch: range
) -> list[Wanted]:
    """The objects of ``batch``'s chunks that L1 lacks, object group by object group,
    with their L2 keys: what a prefetch batch asks L2 for (both read paths)."""
    return [
        (
            og.index,
            i,
            spaces[og.index],
            codec.l2_key(spaces[og.index], keys[i][-codec.CHUNK_KEY_BYTES :]),
        )
        for og in view.layout.object_groups
        for i in index.missing(view, og.index, keys, batch)
    ]


#: Reserves slots for ``Good`` values: (the reservations, the new end).
Reserve = Callable[[CacheView, list[bytes], list[Good], int], tuple[list[Filling], int]]


class SlotFetcher:
    """Runs one prefetch's batches into slots (event-loop thread)."""

    def __init__(
        self,
        index: L1Index,
        backend: L2Backend,
        stats: L2Stats,
        view: PoolView,
        reserve: Reserve,
        filled: Callable[[str, Reservation], None],
    ) -> None:
        self.index = index
        self.backend = backend
        self.stats = stats
        self.view = view
        self.reserve = reserve
        self.filled = filled

    async def fetch(
        self,
        view: CacheView,
        namespace: str,
        keys: list[bytes],
        spaces: list[bytes],
        per_batch: int,
        bad: list[bytes],
    ) -> tuple[int, int]:
        """Every batch in chunk order; returns how many leading chunks L1 now has (or
        L2 had) and how many objects were committed; ``bad`` gets refused keys.

        Two batches in flight: batch i+1's headers are read, its slots reserved and its
        values requested while batch i's are still being received, so no connection
        idles at the end of a batch waiting for the slowest share. (A value found
        damaged only while being received, in batch i, may leave batch i+1's verified
        objects committed past the hole: valid, unreachable until it is filled.)"""
        n = len(keys)
        end, committed = n, 0
        inflight: deque[asyncio.Task[tuple[int, int]]] = deque()
        loop = asyncio.get_running_loop()
        try:
            for first in range(0, n, per_batch):
                if first >= end:
                    break
                batch = range(first, min(n, first + per_batch))
                wanted = wanted_objects(self.index, view, keys, spaces, batch)
                if not wanted:
                    continue
                heads = await self.backend.heads([w[3] for w in wanted])
                good, end = self._check(view, keys, wanted, heads, end, bad)
                reserved, end = self.reserve(view, keys, [g for g in good if g[1] < end], end)
                if reserved:
                    inflight.append(
                        loop.create_task(self._read(view, namespace, spaces, keys, reserved, bad))
                    )
                while len(inflight) >= BATCHES_IN_FLIGHT:
                    done, bad_at = await inflight.popleft()
                    committed += done
                    end = min(end, bad_at)
            while inflight:
                done, bad_at = await inflight.popleft()
                committed += done
                end = min(end, bad_at)
        finally:
            if inflight:  # failed or cancelled: the other reads end (commit or abort)
                await settle.wait_all(inflight)  # first, their failures consumed
        return end, committed

    def _check(
        self,
        view: CacheView,
        keys: list[bytes],
        wanted: list[Wanted],
        heads: list[Head | None],
        end: int,
        bad_keys: list[bytes],
    ) -> tuple[list[Good], int]:
        ogs = view.layout.object_groups
        good: list[Good] = []
        for (og_index, i, space, l2key), head in zip(wanted, heads, strict=True):
            reason: codec.Invalid | None = None
            if head is not None:
                mask, reason = codec.check_head(
                    head[0],
                    head[1],
                    space,
                    keys[i][-codec.CHUNK_KEY_BYTES :],
                    ogs[og_index].object_bytes,
                )
                if reason is None:
                    good.append((og_index, i, mask, head[0], l2key))
                    continue
                self.stats.bump(self.stats.invalid, reason.value)
                if reason is not codec.Invalid.VERSION:  # another format's: not ours
                    bad_keys.append(l2key)
            else:
                self.stats.misses += 1
            if ogs[og_index].has_full:
                end = min(end, i)
        return good, end

    async def _read(
        self,
        view: CacheView,
        namespace: str,
        spaces: list[bytes],
        keys: list[bytes],
        reserved: list[Filling],
        bad_keys: list[bytes],
    ) -> tuple[int, int]:
        """Receive and verify into the reserved slots, then commit or abort each."""
        ogs = view.layout.object_groups
        reads: list[SlotRead] = []
        for f in reserved:
            r: Reservation = f.objects
            nbytes = r.object_bytes
            for j, offset in enumerate(r.offsets().tolist()):
                reads.append(
                    SlotRead(
                        f.l2keys[j],
                        spaces[r.og_index],
                        keys[r.chunks[j]][-codec.CHUNK_KEY_BYTES :],
                        r.masks[j],
                        self.view(int(offset), nbytes).data,
                    )
                )
        t0 = time.perf_counter()
        try:
            results = await self.backend.get_into(reads)
        except BaseException:
            for f in reserved:  # no thread writes to these slots any more
                self.index.finish_fill(f.objects, [False] * len(f.objects))
            raise
        finally:
            reads.clear()
        self.stats.read_latency.observe(time.perf_counter() - t0)
        committed, bad_at, at = 0, 1 << 62, 0
        for f in reserved:
            r = f.objects
            mine = results[at : at + len(r)]
            at += len(r)
            done = self.index.finish_fill(r, [res is True for res in mine])
            committed += len(done)
            self.stats.hits += len(done)
            for j, res in enumerate(mine):
                if res is True or isinstance(res, codec.Invalid):
                    self.stats.bytes_read += codec.HEADER_BYTES + r.object_bytes
                if res is True:
                    continue
                if isinstance(res, codec.Invalid):
                    self.stats.bump(self.stats.invalid, res.value)
                    if res is not codec.Invalid.VERSION:
                        bad_keys.append(f.l2keys[j])
                else:  # absent, or replaced by a value of other sections meanwhile
                    self.stats.misses += 1
                if ogs[r.og_index].has_full:
                    bad_at = min(bad_at, r.chunks[j])
            if done:
                self.filled(namespace, done)
        return committed, bad_at
