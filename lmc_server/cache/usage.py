"""What the pool and each partition hold, for the ``stats`` report, the Prometheus
gauges, the health and STATUS lines.

One :class:`PoolUsage` for the slab pool (:meth:`~lmc_server.cache.index.L1Index.pool_usage`)
and one :class:`PartitionUsage` per partition
(:meth:`~lmc_server.cache.index.L1Index.usage`), read on demand, so the report and the
collector show the same numbers computed once. The collector reads it on the HTTP thread while the
event loop keeps changing the partitions: every field is read with one attribute read
or one C-level call (``array.count``), so a read never fails mid-change; the fields of
one struct may be a request apart, as any scrape of a live server is.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmc_server.cache.pool import Partition


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """The slab pool: its slabs, how many are prepared, how many no partition owns."""

    slab_bytes: int
    slabs: int
    ready_slabs: int  # prepared by the engine (the rest are pending)
    free_slabs: int  # prepared and owned by no partition

    @property
    def capacity_bytes(self) -> int:
        return self.slabs * self.slab_bytes

    @property
    def ready_bytes(self) -> int:
        return self.ready_slabs * self.slab_bytes


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
