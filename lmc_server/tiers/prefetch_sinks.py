"""The two ways a prefetch batch's values reach their L1 slots (the pipeline's sinks).

:class:`~lmc_server.tiers.prefetch.Prefetcher` runs one pipeline for every backend: per
batch it asks its sink to *probe* the objects L1 lacks, checks what came back (one set
of header checks), reserves WRITING slots for the values worth reading, has the sink
*fill* them, and commits the batches in chunk order. The sinks differ only in where the
bytes are when:

- :class:`CopySink` (a backend without ``reads_into_slots``: the disk tier, Mooncake):
  the probe is the read (:meth:`L2Backend.get_many`, whole values); the fill verifies
  each checksum and copies the payload into its slot on the tier's threads.
- :class:`SlotSink` (``reads_into_slots``: Redis): the probe reads only headers and
  lengths (:meth:`L2Backend.heads`, one small round trip), so a missing, damaged or
  foreign value reserves nothing and evicts nothing from L1; the fill has the backend
  receive each value straight into its slot and verify header, mask and checksum on
  its threads (:meth:`L2Backend.get_into`). Several batches are received at once
  (``BATCHES_IN_FLIGHT``), so a connection that finished its share of one batch goes
  on with the next instead of waiting for the slowest share.

Contract of :meth:`Sink.fill`: one :data:`~lmc_server.tiers.backend.ReadResult` per
reserved object, in order; it returns or raises only once no thread writes to any of
the slots (also when cancelled). Only ``True`` may be committed; the pipeline commits
or aborts every slot itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lmc_server.cache.index import L1Index, Reservation
from lmc_server.cache.view import CacheView
from lmc_server.tiers import codec, settle
from lmc_server.tiers.backend import ReadResult, SlotRead, Value
from lmc_server.tiers.context import TierContext

#: Batches being received into slots at once by :class:`SlotSink` (each at most the
#: prefetch's ``READ_BATCH_BYTES`` of reserved slots): 4 of 32 MiB reserve as much L1
#: as 2 of 64 MiB, and keep a connection that finished its share of one batch busy with
#: the next three (Valkey 8, 4 I/O threads, on the H200 host: reads 2.12-2.23 GB/s with
#: 4 x 32 MiB, 1.69-2.03 with 2 x 64 MiB).
BATCHES_IN_FLIGHT = 4

#: What a probe says of one value: the value itself or at least its first
#: ``HEADER_BYTES``, and the value's length; ``None`` where L2 has none.
Probe = tuple[Value, int] | None
#: (object group, chunk, L2 namespace, L2 key) of an object a batch lacks in L1.
Wanted = tuple[int, int, bytes, bytes]
#: (object group, chunk, mask, the probed value or its header, L2 key) of a value worth
#: reading.
Good = tuple[int, int, int, Value, bytes]


@dataclass(frozen=True, slots=True)
class Filling:
    """WRITING slots of one object group and, per object, the probed value (or its
    header) and its L2 key."""

    objects: Reservation
    values: list[Value]
    l2keys: list[bytes]


def wanted_objects(
    index: L1Index, view: CacheView, keys: list[bytes], spaces: list[bytes], batch: range
) -> list[Wanted]:
    """The objects of ``batch``'s chunks that L1 lacks, object group by object group,
    with their L2 keys: what a prefetch batch asks L2 for."""
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


class Sink(Protocol):
    """Where a prefetch's values go (see the module docstring)."""

    #: Batches the pipeline lets :meth:`fill` at once before it waits for the oldest.
    depth: int

    async def probe(self, l2keys: list[bytes]) -> list[Probe]:
        """What L2 holds under each key (one batched round trip)."""
        ...

    def release(self, probed: Sequence[Probe], reserved: list[Filling]) -> None:
        """The probed values no slot was reserved for are not needed any more."""
        ...

    async def fill(
        self, keys: list[bytes], spaces: list[bytes], reserved: list[Filling]
    ) -> list[ReadResult]:
        """Bring each reserved object's bytes into its slot and verify them."""
        ...


class CopySink:
    """Whole values read first, then verified and copied into the slots on the tier's
    threads (the read of batch i+1 overlaps the copies of batch i)."""

    depth = 1

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx

    async def probe(self, l2keys: list[bytes]) -> list[Probe]:
        t0 = time.perf_counter()
        values = await self.ctx.backend.get_many(l2keys)
        self.ctx.stats.read_latency.observe(time.perf_counter() - t0)
        out: list[Probe] = []
        for v in values:
            if v is None:
                out.append(None)
            else:
                self.ctx.stats.bytes_read += len(v)
                out.append((v, len(v)))
        return out

    def release(self, probed: Sequence[Probe], reserved: list[Filling]) -> None:
        kept = {id(v) for f in reserved for v in f.values}
        self.ctx.backend.release([p[0] for p in probed if p is not None and id(p[0]) not in kept])

    async def fill(
        self, keys: list[bytes], spaces: list[bytes], reserved: list[Filling]
    ) -> list[ReadResult]:
        loop = asyncio.get_running_loop()
        jobs = [
            (int(offset), value, f.objects.object_bytes)
            for f in reserved
            for offset, value in zip(f.objects.offsets().tolist(), f.values, strict=True)
        ]
        futures = [loop.run_in_executor(self.ctx.executor, self._fill, *job) for job in jobs]
        try:
            failures = await settle.wait_all(futures)  # no thread copies into a slot after
        finally:
            self.ctx.backend.release([value for _, value, _ in jobs])
        if failures:
            raise failures[0]
        return [True if f.result() else codec.Invalid.CHECKSUM for f in futures]

    def _fill(self, offset: int, value: Value, object_bytes: int) -> bool:
        """Verify the checksum and copy the payload into its slot (worker thread)."""
        if not codec.check_payload(value):
            return False
        payload = np.frombuffer(codec.payload(value), dtype=np.uint8)
        assert payload.size == object_bytes, "the header check let a wrong length through"
        np.copyto(self.ctx.view(offset, object_bytes), payload)
        return True


class SlotSink:
    """Headers read first; values received by the backend straight into the slots."""

    depth = BATCHES_IN_FLIGHT

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx

    async def probe(self, l2keys: list[bytes]) -> list[Probe]:
        return list(await self.ctx.backend.heads(l2keys))

    def release(self, probed: Sequence[Probe], reserved: list[Filling]) -> None:
        return None  # headers only: nothing the backend lends

    async def fill(
        self, keys: list[bytes], spaces: list[bytes], reserved: list[Filling]
    ) -> list[ReadResult]:
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
                        self.ctx.view(int(offset), nbytes).data,
                    )
                )
        t0 = time.perf_counter()
        try:
            results = await self.ctx.backend.get_into(reads)
        finally:
            reads.clear()  # no view of a slot outlives the call
        self.ctx.stats.read_latency.observe(time.perf_counter() - t0)
        at = 0
        for f in reserved:  # what came over the wire: every value received, good or not
            n = len(f.objects)
            self.ctx.stats.bytes_read += sum(
                codec.HEADER_BYTES + f.objects.object_bytes
                for res in results[at : at + n]
                if res is True or isinstance(res, codec.Invalid)
            )
            at += n
        return results
