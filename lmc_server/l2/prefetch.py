"""Prefetch: bring the L2 continuation of a looked-up prefix into L1.

A lookup reports its L1 hit at once; if the prefix continues past it, the tier starts
one prefetch task for the chunks after the hit (at most ``max_chunks``) and the lookup
says how many chunks are being fetched (``LookupResult.l2_pending_chunks``); the
client asks again on its next step and then sees them as ordinary L1 hits (leased and
retrieved like any other).

A prefetch: one batched read of every object (each object group, each chunk) not
already in L1; the header of each value is checked on the loop (cheap) and the objects
of the contiguous run of chunks L2 can complete are reserved in L1 through the index
(WRITING: invisible, the same reservation a store holds); the checksum and the copy
into the slot run on the tier's threads; then the index commits each object, or aborts
it if its checksum failed, from the last chunk to the first as a store's commit does,
so chunk 0 is evicted last. A half-written object is never visible and a value that
fails any check is never served. (A prefetch larger than one read batch commits batch
by batch, in chunk order, so the batches stay visible as they land.) A backend that
receives values into the slots itself (``reads_into_slots``: Redis) reads headers
first and reserves before the read instead: :mod:`lmc_server.l2.prefetch_slots`.

Every chunk an in-flight prefetch covers is remembered, so asking again while one runs
(even after part of it landed and the hit grew) starts nothing and reports what is
still coming; a finished prefetch remembers where L2 stopped having the continuation,
and where it started if it brought nothing (for ``MISS_MEMORY_S``), so a client
polling a prefix L2 does not have (or has only in part) costs one dict lookup per
poll, not one L2 round trip, and sees ``l2_pending_chunks == 0`` once the answer is
known.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from lmc_server.cache.index import L1Index, Reservation, StoreTicket
from lmc_server.cache.view import CacheView
from lmc_server.l2 import codec, settle
from lmc_server.l2.backend import L2Backend, L2Error, Value
from lmc_server.l2.poolview import PoolView
from lmc_server.l2.prefetch_slots import Filling, Good, SlotFetcher, Wanted, wanted_objects
from lmc_server.l2.stats import L2Stats

log = logging.getLogger(__name__)

#: Prefetches running at once; past that a lookup starts none (counted).
MAX_PREFETCHES = 8
#: How long a known L2 miss (a continuation L2 did not have) is remembered.
MISS_MEMORY_S = 1.0
MISS_MEMORY_ENTRIES = 4096
#: Bytes of values one prefetch reads per batch (at most ``BATCHES_IN_FLIGHT`` of
#: prefetch_slots held at a time).
READ_BATCH_BYTES = 32 << 20


class Prefetcher:
    """Starts and runs prefetches (see the module docstring). Event-loop thread only."""

    def __init__(
        self,
        index: L1Index,
        backend: L2Backend,
        stats: L2Stats,
        view: PoolView,
        executor: ThreadPoolExecutor,
        max_chunks: int,
        space: Callable[[str, bytes], bytes],
        is_up: Callable[[], bool],
        on_error: Callable[[L2Error], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.backend = backend
        self.stats = stats
        self.view = view
        self.executor = executor
        self.max_chunks = max_chunks
        self.space = space
        self.is_up = is_up
        self.on_error = on_error
        self.clock = clock
        #: (chunk key, layout fingerprints) of every chunk an in-flight prefetch covers ->
        #: (that prefetch's id, chunks it covers from there to its end).
        self._inflight: dict[Any, tuple[int, int]] = {}
        self._next_id = 0
        #: chunk key -> until when a lookup reaching it starts no prefetch.
        self._missing: dict[bytes, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        #: The next tier down: asked for what this one lacks, as soon as it is known
        #: (``start`` of that tier's prefetcher, set by the tier chain).
        self.fallthrough: Callable[[CacheView, str, list[bytes], int], int] | None = None
        #: Called with the objects a prefetch committed (the chain promotes them into
        #: the tiers above this one).
        self.on_filled: Callable[[str, Reservation], None] | None = None
        self._slots = SlotFetcher(index, backend, stats, view, self._reserve, self._filled)

    def _filled(self, namespace: str, done: Reservation) -> None:
        if self.on_filled is not None:
            self.on_filled(namespace, done)

    def start(self, view: CacheView, namespace: str, keys: list[bytes], hit: int) -> int:
        """Start fetching chunks ``hit..`` of ``keys`` unless known; chunks pending."""
        fps = _fingerprints(view)
        tag = (keys[hit], fps)
        covered = self._inflight.get(tag)
        if covered is not None:
            return covered[1]
        missing_until = self._missing.get(keys[hit])
        if missing_until is not None:
            if missing_until > self.clock():
                return 0
            del self._missing[keys[hit]]
        if not self.is_up() or self._stopping:
            return 0
        if len(self._tasks) >= MAX_PREFETCHES:
            self.stats.prefetches_skipped += 1
            return 0
        want = keys[hit : hit + self.max_chunks]
        self._next_id += 1
        pid = self._next_id
        for i, key in enumerate(want):
            self._inflight[(key, fps)] = (pid, len(want) - i)
        self.stats.prefetches += 1
        task = asyncio.get_running_loop().create_task(
            self._run(view, namespace, want, pid), name="l2-prefetch"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return len(want)

    def _remember_done(self, view: CacheView, keys: list[bytes], end: int, committed: int) -> None:
        """Where L2 stopped having the continuation, and where this prefetch started if
        it brought nothing (e.g. only a sliding window L2 lacks at the end of the prefix
        was missing): a lookup stuck there starts nothing new for ``MISS_MEMORY_S``."""
        if len(self._missing) >= MISS_MEMORY_ENTRIES:
            self._missing.clear()
        until = self.clock() + MISS_MEMORY_S
        if not committed:
            self._missing[keys[0]] = until
        if end < len(keys):
            self._missing[keys[end]] = until

    def committed(self, ticket: StoreTicket) -> None:
        """A store committed these objects here (and queued them for L2): forget any
        memory of them missing, or the next lookup of a prefix L1 loses again within
        ``MISS_MEMORY_S`` would not look in L2 for them."""
        if not self._missing:
            return
        for r in ticket.reserved:
            for key in r.keys:
                self._missing.pop(key, None)

    async def _run(self, view: CacheView, namespace: str, keys: list[bytes], pid: int) -> None:
        bad: list[bytes] = []
        try:
            end, committed = await self._fetch(view, namespace, keys, bad)
            self._remember_done(view, keys, end, committed)
            if end < len(keys) and self.fallthrough is not None:
                self.fallthrough(view, namespace, keys, end)
            if bad:
                await self.backend.discard(bad)
        except L2Error as e:
            self.stats.bump(self.stats.errors, "read")
            self.on_error(e)
        except Exception:
            log.exception("L2 prefetch failed")
            self.stats.bump(self.stats.errors, "read")
        finally:
            fps = _fingerprints(view)
            for key in keys:
                tag = (key, fps)
                covered = self._inflight.get(tag)
                if covered is not None and covered[0] == pid:
                    del self._inflight[tag]

    async def _fetch(
        self, view: CacheView, namespace: str, keys: list[bytes], bad: list[bytes]
    ) -> tuple[int, int]:
        """Fetch and commit, in batches of chunks (``READ_BATCH_BYTES``): batch i+1 is
        read while batch i is verified and copied, and the run stops where a full object
        group is missing. Returns how many leading chunks L1 now has (or L2 had), and
        how many objects were committed; ``bad`` gets the keys of values refused."""
        n = len(keys)
        ogs = view.layout.object_groups
        spaces = [self.space(namespace, og.fingerprint) for og in ogs]
        chunk_bytes = max(1, sum(og.object_bytes for og in ogs))
        per_batch = max(1, READ_BATCH_BYTES // chunk_bytes)
        if self.backend.reads_into_slots:
            return await self._slots.fetch(view, namespace, keys, spaces, per_batch, bad)
        end, committed = n, 0
        filling: asyncio.Task[tuple[int, int]] | None = None  # (the copies of a batch)
        try:
            for first in range(0, n, per_batch):
                if first >= end:
                    break
                batch = range(first, min(n, first + per_batch))
                wanted = wanted_objects(self.index, view, keys, spaces, batch)
                values: list[Value | None] = []
                if wanted:
                    t0 = time.perf_counter()
                    values = await self.backend.get_many([w[3] for w in wanted])
                    self.stats.read_latency.observe(time.perf_counter() - t0)
                if filling is not None:
                    done, bad_at = await asyncio.shield(filling)
                    filling = None
                    committed += done
                    end = min(end, bad_at)
                good, end = self._check(view, keys, wanted, values, end, bad)
                reserved, end = self._reserve(view, keys, [g for g in good if g[1] < end], end)
                kept = {id(v) for f in reserved for v in f.values}
                self.backend.release([v for v in values if id(v) not in kept])
                if reserved:
                    filling = asyncio.get_running_loop().create_task(
                        self._fill_and_commit(view, namespace, reserved, bad)
                    )
            if filling is not None:
                done, bad_at = await asyncio.shield(filling)
                filling = None
                committed += done
                end = min(end, bad_at)
        finally:
            if filling is not None:  # cancelled or failed: the copies end first (shielded:
                await settle.wait_all({filling})  # a slot is never freed under its copy)
        return end, committed

    def _check(
        self,
        view: CacheView,
        keys: list[bytes],
        wanted: list[Wanted],
        values: list[Value | None],
        end: int,
        bad_keys: list[bytes],
    ) -> tuple[list[Good], int]:
        """Header checks (cheap, on the loop): the values worth reserving, and ``end``
        shrunk to the first chunk whose full object group L2 cannot supply."""
        ogs = view.layout.object_groups
        good: list[Good] = []
        for (og_index, i, space, l2key), value in zip(wanted, values, strict=True):
            if value is None:
                self.stats.misses += 1
                if ogs[og_index].has_full:
                    end = min(end, i)
                continue
            self.stats.bytes_read += len(value)
            mask, bad = codec.check_header(
                value, space, keys[i][-codec.CHUNK_KEY_BYTES :], ogs[og_index].object_bytes
            )
            if bad is not None:
                self.stats.bump(self.stats.invalid, bad.value)
                if bad is not codec.Invalid.VERSION:  # another format's: not ours to delete
                    bad_keys.append(l2key)
                if ogs[og_index].has_full:
                    end = min(end, i)
                continue
            good.append((og_index, i, mask, value, l2key))
        return good, end

    async def _fill_and_commit(
        self, view: CacheView, namespace: str, reserved: list[Filling], bad_keys: list[bytes]
    ) -> tuple[int, int]:
        """Verify and copy on the tier's threads, then commit (or abort) each object.

        Returns ``(objects committed, first chunk of a full object group that failed
        its checksum, or a large number)``.
        """
        ogs = view.layout.object_groups
        loop = asyncio.get_running_loop()
        ok: list[bool] = []
        committed, bad_at = 0, 1 << 62
        filled: list[Reservation] = []
        try:
            jobs = [
                (offset, value)
                for f in reserved
                for offset, value in zip(f.objects.offsets().tolist(), f.values, strict=True)
            ]
            ok = list(
                await asyncio.gather(
                    *(
                        loop.run_in_executor(self.executor, self._fill, int(offset), value)
                        for offset, value in jobs
                    )
                )
            )
            # Every copy has finished (else gather raised): the values may be reused.
            self.backend.release([value for _, value in jobs])
        finally:
            at = 0
            for f in reserved:
                r, n = f.objects, len(f.objects)
                done = self.index.finish_fill(
                    r, [at + j < len(ok) and ok[at + j] for j in range(n)]
                )
                committed += len(done)
                self.stats.hits += len(done)
                if done:
                    filled.append(done)
                for j in range(n):
                    if at + j < len(ok) and not ok[at + j]:
                        self.stats.bump(self.stats.invalid, codec.Invalid.CHECKSUM.value)
                        bad_keys.append(f.l2keys[j])
                        if ogs[r.og_index].has_full:
                            bad_at = min(bad_at, r.chunks[j])
                at += n
        if self.on_filled is not None:
            for done in filled:
                self.on_filled(namespace, done)
        return committed, bad_at

    def _reserve(
        self,
        view: CacheView,
        keys: list[bytes],
        good: list[Good],
        end: int,
    ) -> tuple[list[Filling], int]:
        """Reserve a WRITING slot per object through the index (which skips keys a
        store took meanwhile); ``end`` shrinks to the first chunk of a full object group
        L1 had no room for."""
        by_og: dict[int, list[tuple[int, int, Value, bytes]]] = {}
        for og_index, i, mask, value, l2key in good:
            by_og.setdefault(og_index, []).append((i, mask, value, l2key))
        wanted = {
            og_index: ([it[0] for it in items], [it[1] for it in items])
            for og_index, items in by_og.items()
        }
        reserved, no_space = self.index.reserve_fill(view, keys, wanted)
        for og_index, left in no_space.items():
            self.stats.prefetch_no_space += len(left)
            if view.layout.object_groups[og_index].has_full:
                end = min(end, left[0])
        out: list[Filling] = []
        for r in reserved:
            fetched = {it[0]: it for it in by_og[r.og_index]}
            items = [fetched[i] for i in r.chunks]
            out.append(Filling(r, [it[2] for it in items], [it[3] for it in items]))
        return out, end

    def _fill(self, offset: int, value: Value) -> bool:
        """Verify the checksum and copy the payload into its slot (worker thread)."""
        if not codec.check_payload(value):
            return False
        payload = np.frombuffer(codec.payload(value), dtype=np.uint8)
        np.copyto(self.view(offset, payload.size), payload)
        return True

    async def stop(self, timeout_s: float) -> None:
        """Wait for running prefetches (their copies touch the pool), then cancel."""
        self._stopping = True
        tasks = set(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def _fingerprints(view: CacheView) -> tuple[bytes, ...]:
    """What names a view's partitions: the layout fingerprints of its object groups."""
    return tuple(og.fingerprint for og in view.layout.object_groups)
