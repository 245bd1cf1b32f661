"""Prefetch: bring the L2 continuation of a looked-up prefix into L1.

A lookup reports its L1 hit at once; if the prefix continues past it, the tier starts
one prefetch task for the chunks after the hit (at most ``max_chunks``) and the lookup
says how many chunks are being fetched (``LookupResult.l2_pending_chunks``); the
client asks again on its next step and then sees them as ordinary L1 hits (leased and
retrieved like any other).

One pipeline, for every backend, in batches of chunks (``READ_BATCH_BYTES``). Per
batch: the objects (each object group, each chunk) L1 lacks are *probed* (whole values,
or only their headers for a backend that reads into slots); one set of header checks
runs on the loop (cheap); the objects of the contiguous run of chunks L2 can complete
are reserved in L1 through the index (WRITING: invisible, the same reservation a store
holds); the sink *fills* the slots (verifies every checksum, on threads); then the
batch is committed, or each object aborted. Where the bytes are when is the sink's
business (:mod:`lmc_server.tiers.prefetch_sinks`): a copy from values read first, or a
backend receiving values straight into the slots, several batches at once.

Invariants:

- **No half-written object is visible and nothing wrong is served**: only an object
  whose fill returned ``True`` (header, mask, checksum verified, every byte in its
  slot) is committed; every other slot of the prefetch is aborted, also when it fails
  or is cancelled (its fills end first: no slot is freed under a thread writing it).
- **Chunk order**: batches commit strictly first to last, whatever order their fills
  end in, and once a chunk of a full object group is known missing (a miss, a refused
  value, a failed checksum, no room in L1) no object of a later chunk is committed by
  this prefetch: a verified object past the hole is aborted. So a prefetch never makes
  chunk k+1 visible before chunk k, and a lookup never finds a prefix with a hole the
  prefetch left. (Within a batch, objects commit from the last chunk to the first in
  one step of the loop, as a store's do: no lookup runs in between.)
- **Eviction order**: every object the prefetch commits stays pinned until the
  prefetch ends (its later batches cannot evict its earlier ones), then is unpinned
  from the last chunk to the first, so under LRU (and the policies that order by use)
  chunk 0, which every longer hit needs, ends most recent and is evicted last, as
  after a store of the whole prefix. Under FIFO the order is commit order by
  definition: a prefetch's earlier batches are older than its later ones.
- **Every future is awaited** (:mod:`lmc_server.tiers.settle`).

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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmc_server.cache.index import Reservation, StoreTicket
from lmc_server.cache.view import CacheView
from lmc_server.tiers import codec, settle
from lmc_server.tiers.backend import L2Error, ReadResult
from lmc_server.tiers.context import TierContext
from lmc_server.tiers.prefetch_sinks import (
    CopySink,
    Filling,
    Good,
    Probe,
    Sink,
    SlotSink,
    Wanted,
    wanted_objects,
)

log = logging.getLogger(__name__)

#: Prefetches running at once; past that a lookup starts none (counted).
MAX_PREFETCHES = 8
#: How long a known L2 miss (a continuation L2 did not have) is remembered.
MISS_MEMORY_S = 1.0
MISS_MEMORY_ENTRIES = 4096
#: Bytes of values one prefetch reads per batch (the sink fills at most its ``depth``
#: batches at a time).
READ_BATCH_BYTES = 32 << 20
#: Sentinel ``end``: no chunk found missing yet.
_NO_HOLE = 1 << 62


@dataclass(slots=True)
class _Run:
    """One prefetch's state while its batches move through the pipeline."""

    view: CacheView
    namespace: str
    keys: list[bytes]
    spaces: list[bytes]
    #: Keys of values refused (deleted from L2 afterwards).
    bad: list[bytes]
    #: The first chunk of a full object group known missing (a later chunk is never
    #: committed); ``len(keys)`` while none is.
    end: int
    committed: int = 0
    #: (reservation, object) of every object committed, pinned until the prefetch ends.
    pins: list[tuple[Reservation, int]] = field(default_factory=list)


class Prefetcher:
    """Starts and runs prefetches (see the module docstring). Event-loop thread only."""

    def __init__(self, ctx: TierContext, max_chunks: int) -> None:
        self.ctx = ctx
        self.max_chunks = max_chunks
        #: (chunk key, layout fingerprints) of every chunk an in-flight prefetch covers ->
        #: (that prefetch's id, chunks it covers from there to its end).
        self._inflight: dict[Any, tuple[int, int]] = {}
        self._next_id = 0
        #: chunk key -> until when a lookup reaching it starts no prefetch.
        self._missing: dict[bytes, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._sink: Sink = SlotSink(ctx) if ctx.backend.reads_into_slots else CopySink(ctx)
        #: The next tier down: asked for what this one lacks, as soon as it is known
        #: (``start`` of that tier's prefetcher, set by the tier chain).
        self.fallthrough: Callable[[CacheView, str, list[bytes], int], int] | None = None
        #: Called with the objects a prefetch committed (the chain promotes them into
        #: the tiers above this one).
        self.on_filled: Callable[[str, Reservation], None] | None = None

    def start(self, view: CacheView, namespace: str, keys: list[bytes], hit: int) -> int:
        """Start fetching chunks ``hit..`` of ``keys`` unless known; chunks pending."""
        fps = _fingerprints(view)
        tag = (keys[hit], fps)
        covered = self._inflight.get(tag)
        if covered is not None:
            return covered[1]
        missing_until = self._missing.get(keys[hit])
        if missing_until is not None:
            if missing_until > self.ctx.clock():
                return 0
            del self._missing[keys[hit]]
        if not self.ctx.is_up() or self._stopping:
            return 0
        if len(self._tasks) >= MAX_PREFETCHES:
            self.ctx.stats.prefetches_skipped += 1
            return 0
        want = keys[hit : hit + self.max_chunks]
        self._next_id += 1
        pid = self._next_id
        for i, key in enumerate(want):
            self._inflight[(key, fps)] = (pid, len(want) - i)
        self.ctx.stats.prefetches += 1
        task = asyncio.get_running_loop().create_task(
            self._run(view, namespace, want, pid), name="l2-prefetch"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return len(want)

    def _remember_done(self, keys: list[bytes], end: int, committed: int) -> None:
        """Where L2 stopped having the continuation, and where this prefetch started if
        it brought nothing (e.g. only a sliding window L2 lacks at the end of the prefix
        was missing): a lookup stuck there starts nothing new for ``MISS_MEMORY_S``."""
        if len(self._missing) >= MISS_MEMORY_ENTRIES:
            self._missing.clear()
        until = self.ctx.clock() + MISS_MEMORY_S
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
            self._remember_done(keys, end, committed)
            if end < len(keys) and self.fallthrough is not None:
                self.fallthrough(view, namespace, keys, end)
            if bad:
                await self.ctx.backend.discard(bad)
        except L2Error as e:
            self.ctx.stats.bump(self.ctx.stats.errors, "read")
            self.ctx.on_error(e)
        except Exception:
            log.exception("L2 prefetch failed")
            self.ctx.stats.bump(self.ctx.stats.errors, "read")
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
        """Probe, check, reserve, fill and commit, batch after batch, in chunk order:
        batch i+1 is probed while up to the sink's ``depth`` batches are being filled,
        and the run stops where a full object group is missing. Returns how many
        leading chunks L1 now has (or L2 had), and how many objects were committed;
        ``bad`` gets the keys of values refused."""
        n = len(keys)
        ogs = view.layout.object_groups
        spaces = [self.ctx.space(namespace, og.fingerprint) for og in ogs]
        chunk_bytes = max(1, sum(og.object_bytes for og in ogs))
        per_batch = max(1, READ_BATCH_BYTES // chunk_bytes)
        run = _Run(view, namespace, keys, spaces, bad, n)
        sink = self._sink
        loop = asyncio.get_running_loop()
        #: Batches being filled, oldest first: committed only in this order.
        filling: deque[tuple[list[Filling], asyncio.Task[list[ReadResult]]]] = deque()
        try:
            for first in range(0, n, per_batch):
                if first >= run.end:
                    break
                batch = range(first, min(n, first + per_batch))
                wanted = wanted_objects(self.ctx.index, view, keys, spaces, batch)
                if not wanted:
                    continue
                probed = await sink.probe([w[3] for w in wanted])
                while len(filling) >= sink.depth:  # its outcome may move ``end``
                    await self._commit_oldest(run, filling)
                good = self._check(run, wanted, probed)
                reserved = self._reserve(run, [g for g in good if g[1] < run.end])
                sink.release(probed, reserved)
                if reserved:
                    filling.append((reserved, loop.create_task(sink.fill(keys, spaces, reserved))))
            while filling:
                await self._commit_oldest(run, filling)
        finally:
            if filling:  # failed or cancelled: every fill ends (no thread writes to a
                await settle.wait_all([t for _, t in filling])  # slot), then aborts
                for reserved, _ in filling:
                    for f in reserved:
                        self.ctx.index.finish_fill(f.objects, [False] * len(f.objects))
            for objects, j in reversed(run.pins):  # last chunk first: chunk 0 ends the
                self.ctx.index.unpin_object(objects, j)  # most recent
        return min(run.end, n), run.committed

    def _check(self, run: _Run, wanted: list[Wanted], probed: list[Probe]) -> list[Good]:
        """Header checks (cheap, on the loop): the values worth reserving; ``run.end``
        shrinks to the first chunk whose full object group L2 cannot supply."""
        ogs = run.view.layout.object_groups
        stats = self.ctx.stats
        good: list[Good] = []
        for (og_index, i, space, l2key), p in zip(wanted, probed, strict=True):
            if p is None:
                stats.misses += 1
            else:
                head, value_bytes = p
                mask, reason = codec.check_head(
                    head,
                    value_bytes,
                    space,
                    run.keys[i][-codec.CHUNK_KEY_BYTES :],
                    ogs[og_index].object_bytes,
                )
                if reason is None:
                    good.append((og_index, i, mask, head, l2key))
                    continue
                stats.bump(stats.invalid, reason.value)
                if reason is not codec.Invalid.VERSION:  # another format's: not ours
                    run.bad.append(l2key)
            if ogs[og_index].has_full:
                run.end = min(run.end, i)
        return good

    def _reserve(self, run: _Run, good: list[Good]) -> list[Filling]:
        """Reserve a WRITING slot per object through the index (which skips keys a
        store took meanwhile); ``run.end`` shrinks to the first chunk of a full object
        group L1 had no room for."""
        by_og: dict[int, list[tuple[int, int, Any, bytes]]] = {}
        for og_index, i, mask, value, l2key in good:
            by_og.setdefault(og_index, []).append((i, mask, value, l2key))
        wanted = {
            og_index: ([it[0] for it in items], [it[1] for it in items])
            for og_index, items in by_og.items()
        }
        reserved, no_space = self.ctx.index.reserve_fill(run.view, run.keys, wanted)
        for og_index, left in no_space.items():
            self.ctx.stats.prefetch_no_space += len(left)
            if run.view.layout.object_groups[og_index].has_full:
                run.end = min(run.end, left[0])
        out: list[Filling] = []
        for r in reserved:
            fetched = {it[0]: it for it in by_og[r.og_index]}
            items = [fetched[i] for i in r.chunks]
            out.append(Filling(r, [it[2] for it in items], [it[3] for it in items]))
        return out

    async def _commit_oldest(
        self, run: _Run, filling: deque[tuple[list[Filling], asyncio.Task[list[ReadResult]]]]
    ) -> None:
        """Wait for the oldest batch's fill and commit it. If the fill raised, the batch
        stays in ``filling`` (the caller's ``finally`` aborts it)."""
        results = await filling[0][1]
        reserved, _ = filling.popleft()
        self._commit(run, reserved, results)

    def _commit(self, run: _Run, reserved: list[Filling], results: list[ReadResult]) -> None:
        """Commit one batch's verified objects before ``run.end`` and abort the others
        (one step of the loop); count the outcomes; pin what was committed."""
        ogs = run.view.layout.object_groups
        stats, index = self.ctx.stats, self.ctx.index
        at = 0
        for f in reserved:  # first every failure: a hole moves ``end`` for the batch
            r = f.objects
            for j, res in enumerate(results[at : at + len(r)]):
                if res is True:
                    continue
                if isinstance(res, codec.Invalid):
                    stats.bump(stats.invalid, res.value)
                    if res is not codec.Invalid.VERSION:
                        run.bad.append(f.l2keys[j])
                else:  # absent, or replaced by a value of other sections meanwhile
                    stats.misses += 1
                if ogs[r.og_index].has_full:
                    run.end = min(run.end, r.chunks[j])
            at += len(r)
        at = 0
        for f in reserved:
            r = f.objects
            mine = results[at : at + len(r)]
            at += len(r)
            done = index.finish_fill(
                r, [res is True and c < run.end for res, c in zip(mine, r.chunks, strict=True)]
            )
            if not done:
                continue
            run.committed += len(done)
            stats.hits += len(done)
            for j in range(len(done)):
                at_pin = index.pin_object(done, j)
                assert at_pin is not None, "an object just committed is in L1"
                run.pins.append((done, j))
            if self.on_filled is not None:
                self.on_filled(run.namespace, done)

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
