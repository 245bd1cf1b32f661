"""What one partition holds, for the ``stats`` report and the Prometheus gauges.

One :class:`PartitionUsage` per partition, read on demand
(:meth:`~lmc_server.cache.index.L1Index.usage`), so the report and the collector show
the same numbers computed once. The collector reads it on the HTTP thread while the
event loop keeps changing the partitions: every field is read with one attribute read
or one C-level call (``array.count``), so a read never fails mid-change; the fields of
one struct may be a request apart, as any scrape of a live server is.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmc_server.cache.pool import Partition


@dataclass(frozen=True, slots=True)
class PartitionUsage:
    """Capacity and use of one partition (one object layout)."""

    name: str
    fingerprint: bytes
    object_bytes: int
    slabs: int
    capacity_objects: int
    capacity_bytes: int
    objects: int  # committed (visible)
    writing: int  # being written (invisible)
    used_bytes: int  # committed and being written
    pinned_objects: int  # by leases, retrieves and L2 writes (not evictable)
    pinned_bytes: int


def usage_of(part: Partition) -> PartitionUsage:
    pins = part.pins
    pinned = len(pins) - pins.count(0)
    slabs = part.slabs
    return PartitionUsage(
        name=part.name,
        fingerprint=part.fingerprint,
        object_bytes=part.object_bytes,
        slabs=slabs,
        capacity_objects=slabs * part.slots_per_slab,
        capacity_bytes=slabs * part.pool.slab_bytes,
        objects=part.n_committed,
        writing=part.n_writing,
        used_bytes=part.used_bytes,
        pinned_objects=pinned,
        pinned_bytes=pinned * part.object_bytes,
    )
