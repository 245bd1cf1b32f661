"""Where object slots lie in a slab: the stride between two slots, and the alignment of
large ones.

Public, unlike the slab pool itself (:mod:`lmc_server.cache.slab_pool`): the disk tier
writes slots with direct I/O from where they lie, and the benchmarks model a pool, both
by the same stride the partitions carve their slabs with.
"""

from __future__ import annotations

#: Slots of objects at least this large are :data:`SLOT_ALIGN_BYTES`-aligned.
ALIGNED_SLOT_MIN_BYTES = 256 << 10
#: The alignment of such slots: every logical block size a disk uses.
SLOT_ALIGN_BYTES = 4096


def slot_stride(object_bytes: int, slab_bytes: int) -> int:
    """The distance between two slots of ``object_bytes`` objects in a slab of
    ``slab_bytes``: the object size rounded up to :data:`SLOT_ALIGN_BYTES` for objects
    of at least :data:`ALIGNED_SLOT_MIN_BYTES`, where that leaves as many slots in a
    slab (it never costs a slot; the bytes it leaves unused are at most 1.6 % of a slot,
    0.15 % for the DSV4.1 preset's 2-3 MB objects); else the object size (packed)."""
    if object_bytes < ALIGNED_SLOT_MIN_BYTES:
        return object_bytes
    aligned = -(-object_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
    if slab_bytes // aligned < slab_bytes // object_bytes:
        return object_bytes
    return aligned
