"""Write-behind: committed L1 objects are copied to L2 in the background.

When: at commit. Every object a store commits is queued at once, so another server
sharing the L2 store can hit it within a round trip, and a server restarted after a
crash finds its working set in L2. (Writing at eviction would write less, but only
what L1 no longer wants, after the moment it was most useful to other hosts, and
nothing at all for objects still in L1 when the server dies.)

The queue is bounded in objects (``max_objects``). It holds the reservations the
index committed (:class:`~lmc_server.cache.reservation.Reservation`), not bytes: at
write time the index pins each object that is still there
(:meth:`~lmc_server.cache.index.L1Index.pin_object`: an evicted one is counted and
skipped; a pinned one cannot be evicted, its slot not reused, while pinned). The writer
builds the values (header, checksum, one copy of the payload) on its own threads,
unpins, and sends one pipelined batch. A backend that writes from the slots itself
(``writes_from_slots``: the disk tier, Redis) gets the pinned slots instead and builds
and writes each value on its own I/O threads; its objects stay pinned until the batch
is written, with at most ``SLOT_BATCHES_IN_FLIGHT`` batches (each at most
``WRITE_BATCH_BYTES``) pinned at a time per shard of the backend (a cluster's
primaries, :attr:`~lmc_server.tiers.backend.L2Backend.write_shards`); the next batch
goes out as soon as any of them is written, not only the oldest. Nothing here
ever waits for L2 on a store's or retrieve's path: when the queue is full, or L2 is
down, new writes are dropped and counted. While the tier's first connect after the
start is under way, writes wait in the queue (within its bounds) and go out once it
connects; if that connect fails they are dropped as ``l2_down``. (Dropped at once, the
first stores after a start never reached a disk directory whose check took longer
than the pool's preparation.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from lmc_server.cache.index import Reservation, StoreTicket
from lmc_server.tiers import codec
from lmc_server.tiers.backend import L2Error, SlotObject, Value
from lmc_server.tiers.context import TierContext

log = logging.getLogger(__name__)

#: One batch: at most this many objects and (about) this many bytes per round trip.
WRITE_BATCH_OBJECTS = 64
WRITE_BATCH_BYTES = 32 << 20
#: Batches handed to a backend that writes from the slots, per shard of it, before the
#: writer waits for one of them to be written: the backend's threads go on to batch i+1
#: while the last objects of batch i are written, instead of idling at the end of every
#: batch. Bounds what the writer pins: at most this many batches per shard (4 x 32 MiB:
#: as much as 2 x 64 MiB; on the H200 host with Valkey 8 and 4 I/O threads, writes
#: 1.86-2.41 GB/s with 2 x 64 MiB, 2.03-2.22 with 4 x 32 MiB, one run each; a cluster of
#: three primaries: 12 x 32 MiB).
SLOT_BATCHES_IN_FLIGHT = 4
#: The share of L1 each tier's queue may keep pinned from commit until written (see
#: :class:`WriteBehind`): with a disk tier and L2, at most half of L1 is pinned for
#: writes (an object queued for both is pinned once in memory), the rest is evicted
#: as usual, so stores never find L1 all pinned.
WRITE_PIN_FRACTION = 0.25


@dataclass(slots=True)
class _Pending:
    """Objects ``next .. end-1`` of one committed reservation, waiting to be written;
    those before ``pinned_end`` were pinned in L1 when queued (see :class:`WriteBehind`)."""

    space: bytes
    objects: Reservation
    next: int
    end: int
    pinned_end: int = 0


class WriteBehind:
    """The bounded write queue and the task that drains it (see the module docstring).

    Queued objects are pinned in L1 from their commit until written, up to
    ``pin_budget_bytes`` of them (``pinned_bytes``): L1 evicts other objects first, so
    under a store rate above the tier's, what is committed is written in commit order
    as long as the backlog fits the budget, instead of being evicted from L1 before
    its turn (``dropped_writes{reason="evicted"}``). Objects queued past the budget are
    not pinned (they are written if L1 still holds them at their turn). Invariant:
    ``pinned_bytes`` is the bytes of the queued and in-flight objects pinned at
    enqueue, never above ``pin_budget_bytes``.
    """

    def __init__(
        self,
        ctx: TierContext,
        max_objects: int,
        on_stored: Callable[[list[bytes]], None] = lambda keys: None,
        pin_budget_bytes: int = 0,
        name: str = "L2",
    ) -> None:
        self.ctx = ctx
        self.max_objects = max_objects
        self.on_stored = on_stored
        self.pin_budget_bytes = pin_budget_bytes
        #: The tier, as logs name it.
        self.name = name
        self.pinned_bytes = 0
        self._queue: deque[_Pending] = deque()
        self.depth = 0  # objects queued
        self.in_flight = 0  # objects taken from the queue, not yet written or dropped
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="l2-writer")

    def wake(self) -> None:
        """Look at the queue again (the tier has just connected)."""
        self._wake.set()

    def enqueue(self, namespace: str, ticket: StoreTicket) -> None:
        """Queue the objects a store just committed (event loop; O(1) per object group,
        no IO)."""
        for r in ticket.reserved:
            self.enqueue_objects(namespace, r)

    def enqueue_objects(self, namespace: str, objects: Reservation) -> None:
        """Queue committed objects of one partition (a store's, or a prefetch's from a
        lower tier being promoted into this one)."""
        n = len(objects)
        if not self.ctx.is_up() and not self.ctx.is_connecting():
            self.ctx.stats.bump(self.ctx.stats.dropped_writes, "l2_down", n)
            return
        room = self.max_objects - self.depth
        if room < n:
            self.ctx.stats.bump(self.ctx.stats.dropped_writes, "queue_full", n - max(room, 0))
            n = max(room, 0)
            if n == 0:
                return
        pinned = 0
        obj_bytes = objects.object_bytes
        while (
            pinned < n
            and self.pinned_bytes + obj_bytes <= self.pin_budget_bytes
            and self.ctx.index.pin_object(objects, pinned) is not None
        ):
            pinned += 1
            self.pinned_bytes += obj_bytes
        self._queue.append(
            _Pending(self.ctx.space(namespace, objects.fingerprint), objects, 0, n, pinned)
        )
        self.depth += n
        self._wake.set()

    def _take_batch(self) -> list[tuple[bytes, Reservation, int, bool]]:
        """Pop up to one batch of ``(space, reservation, object position, pinned at
        enqueue)``."""
        out: list[tuple[bytes, Reservation, int, bool]] = []
        nbytes = 0
        while self._queue and len(out) < WRITE_BATCH_OBJECTS and nbytes < WRITE_BATCH_BYTES:
            p = self._queue[0]
            object_bytes = p.objects.object_bytes
            take = min(
                p.end - p.next,
                WRITE_BATCH_OBJECTS - len(out),
                max(1, (WRITE_BATCH_BYTES - nbytes) // object_bytes),
            )
            out += [(p.space, p.objects, j, j < p.pinned_end) for j in range(p.next, p.next + take)]
            nbytes += take * object_bytes
            p.next += take
            if p.next == p.end:
                self._queue.popleft()
        self.depth -= len(out)
        return out

    def drop_all(self, reason: str) -> None:
        if self.depth:
            self.ctx.stats.bump(self.ctx.stats.dropped_writes, reason, self.depth)
        for p in self._queue:
            for j in range(p.next, p.pinned_end):
                self._unpin_queued(p.objects, j)
        self._queue.clear()
        self.depth = 0

    def _forget_batch(self, batch: list[tuple[bytes, Reservation, int, bool]]) -> None:
        """A batch taken from the queue that will not be written (shutdown)."""
        for _, objects, j, queued_pin in batch:
            if queued_pin:
                self._unpin_queued(objects, j)
        self.in_flight -= len(batch)
        self.ctx.stats.bump(self.ctx.stats.dropped_writes, "shutdown", len(batch))

    def _unpin_queued(self, objects: Reservation, j: int) -> None:
        """Release the pin object ``j`` of ``objects`` took when it was queued."""
        self.ctx.index.unpin_object(objects, j)
        self.pinned_bytes -= objects.object_bytes

    async def _run(self) -> None:
        """Drain the queue: build batch i+1's values while batch i is being sent."""
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            sending: deque[asyncio.Task[None]] = deque()
            slot_batches: set[asyncio.Task[None]] = set()
            loop = asyncio.get_running_loop()
            try:
                while self._queue and not self._closing:
                    if not self.ctx.is_up():
                        if not self.ctx.is_connecting():  # else: woken once it connects
                            self.drop_all("l2_down")
                        break
                    batch = self._take_batch()
                    self.in_flight += len(batch)
                    if self.ctx.backend.writes_from_slots:  # nothing to build ahead
                        limit = SLOT_BATCHES_IN_FLIGHT * max(1, self.ctx.backend.write_shards)
                        try:
                            while len(slot_batches) >= limit:
                                done, _ = await asyncio.wait(
                                    slot_batches, return_when=asyncio.FIRST_COMPLETED
                                )
                                slot_batches -= done
                                # read every one's outcome (none left unretrieved); a bug
                                # in _send_slots is raised and logged below
                                errors = [e for t in done if (e := t.exception()) is not None]
                                if errors:
                                    raise errors[0]
                        except BaseException:  # cancelled at shutdown: unpin, uncount
                            self._forget_batch(batch)
                            raise
                        slot_batches.add(loop.create_task(self._send_slots(batch)))
                        continue
                    try:
                        items = await self._encode_batch(batch)
                    except BaseException:
                        self.in_flight -= len(batch)
                        raise
                    while sending:
                        await sending.popleft()
                    sending.append(loop.create_task(self._send(items, len(batch))))
            except Exception:  # a bug, not the store: keep writing later batches
                log.exception("L2 write-behind batch failed")
                self.ctx.stats.bump(self.ctx.stats.errors, "write")
            finally:
                if sending or slot_batches:
                    await asyncio.gather(*sending, *slot_batches, return_exceptions=True)

    def _pin(
        self, batch: list[tuple[bytes, Reservation, int, bool]]
    ) -> tuple[list[tuple[bytes, bytes, int, int, int]], list[tuple[Reservation, int]]]:
        """Pin the objects of ``batch`` still in L1 (event loop): the jobs
        ``(space, chunk key, mask, offset, bytes)`` and the pins to undo (those taken
        at enqueue are released here, the write's own pin holds them until written)."""
        jobs: list[tuple[bytes, bytes, int, int, int]] = []
        pinned: list[tuple[Reservation, int]] = []
        for space, objects, j, queued_pin in batch:
            at = self.ctx.index.pin_object(objects, j)
            if queued_pin:
                self._unpin_queued(objects, j)
            if at is None:
                self.ctx.stats.bump(self.ctx.stats.dropped_writes, "evicted")
                continue
            pinned.append((objects, j))
            offset, mask = at
            jobs.append(
                (
                    space,
                    objects.keys[j][-codec.CHUNK_KEY_BYTES :],
                    mask,
                    offset,
                    objects.object_bytes,
                )
            )
        return jobs, pinned

    async def _encode_batch(
        self, batch: list[tuple[bytes, Reservation, int, bool]]
    ) -> list[tuple[bytes, Value]]:
        """``(L2 key, value)`` of each object still in L1 (pinned during the copy)."""
        jobs, pinned = self._pin(batch)
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        try:
            values = await asyncio.gather(
                *(loop.run_in_executor(self.ctx.executor, self._encode, *job) for job in jobs)
            )
        finally:
            for objects, j in pinned:
                self.ctx.index.unpin_object(objects, j)
        return [(codec.l2_key(job[0], job[1]), v) for job, v in zip(jobs, values, strict=True)]

    async def _send_slots(self, batch: list[tuple[bytes, Reservation, int, bool]]) -> None:
        """Write ``batch`` straight from its slots (:attr:`L2Backend.writes_from_slots`),
        pinned until the backend returns; the objects leave ``in_flight`` however it
        ends."""
        pinned: list[tuple[Reservation, int]] = []
        try:
            jobs, pinned = self._pin(batch)
            objects = [
                SlotObject(codec.l2_key(sp, ck), sp, ck, mask, self.ctx.view(off, n).data)
                for sp, ck, mask, off, n in jobs
            ]
            await self._put(
                self.ctx.backend.put_slots(objects), [(o.key, o.value_bytes) for o in objects]
            )
        finally:
            for reservation, j in pinned:
                self.ctx.index.unpin_object(reservation, j)
            self.in_flight -= len(batch)

    async def _send(self, items: list[tuple[bytes, Value]], taken: int) -> None:
        """Write one batch; ``taken`` objects leave ``in_flight`` however it ends."""
        try:
            await self._put(self.ctx.backend.put_many(items), [(k, len(v)) for k, v in items])
        finally:
            self.in_flight -= taken

    async def _put(self, put: Coroutine[Any, Any, None], sizes: list[tuple[bytes, int]]) -> None:
        """Await one batch's write ``put`` of ``sizes`` (L2 key, value bytes); count it."""
        if not sizes:
            put.close()
            return
        t0 = time.perf_counter()
        try:
            await put
        except L2Error as e:
            if e.dropped == "error":
                self.ctx.stats.bump(self.ctx.stats.errors, "write")
            self.ctx.stats.bump(
                self.ctx.stats.dropped_writes, e.dropped, len(sizes) - len(e.written)
            )
            self.ctx.on_error(e)
            if e.written:
                nbytes = dict(sizes)
                self._written(e.written, sum(nbytes[k] for k in e.written))
            return
        except Exception:
            log.exception("L2 write failed")
            self.ctx.stats.bump(self.ctx.stats.errors, "write")
            self.ctx.stats.bump(self.ctx.stats.dropped_writes, "error", len(sizes))
            return
        self.ctx.stats.write_latency.observe(time.perf_counter() - t0)
        self._written([k for k, _ in sizes], sum(n for _, n in sizes))

    def _written(self, keys: list[bytes], nbytes: int) -> None:
        self.ctx.stats.objects_written += len(keys)
        self.ctx.stats.bytes_written += nbytes
        self.on_stored(keys)

    def _encode(self, space: bytes, chunk_key: bytes, mask: int, offset: int, nbytes: int) -> Value:
        """Header and payload of one object (worker thread; the slot is pinned)."""
        return self.ctx.backend.encode(space, chunk_key, mask, self.ctx.view(offset, nbytes).data)

    async def drain(self, timeout_s: float) -> None:
        """Write out the queue (shutdown, before :meth:`stop`): return once nothing is
        queued or in flight, the tier is degraded, or ``timeout_s`` passed."""
        if not (self.depth or self.in_flight) or not self.ctx.is_up():
            return
        t0 = time.monotonic()
        log.info(
            "%s: writing out %d queued objects before shutdown (up to %.0f s)",
            self.name,
            self.depth + self.in_flight,
            timeout_s,
        )
        self._wake.set()
        while (self.depth or self.in_flight) and self.ctx.is_up():
            left = t0 + timeout_s - time.monotonic()
            if left <= 0:
                log.warning(
                    "%s: drain timeout: %d queued objects not written (dropped as "
                    "shutdown); raise --drain-timeout-s",
                    self.name,
                    self.depth + self.in_flight,
                )
                return
            await asyncio.sleep(min(0.01, left))
        log.info("%s: queue written out in %.2f s", self.name, time.monotonic() - t0)

    async def stop(self, timeout_s: float) -> None:
        """Stop after the batch in progress (its copies are finished before returning);
        what is still queued is dropped (``shutdown``)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        self.drop_all("shutdown")
