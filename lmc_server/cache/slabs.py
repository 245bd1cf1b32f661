"""The slab pool: which slabs of the L1 pool are ready, and which partition owns each.

The L1 pool (one large host allocation owned by the transfer engine) is carved into
``slab_bytes`` slabs. A slab is pending until the engine has made it usable (pinned or
populated, in the background), then free, then owned by exactly one partition, which
carves it into equal object slots (:mod:`lmc_server.cache.pool`, private to the core).
The server marks slabs ready as the engine reports them and reads the pool's capacity;
no bytes are touched here.
"""

from __future__ import annotations

from array import array

PENDING_SLAB = -2
FREE_SLAB = -1


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


class SlabPool:
    """Which slabs are ready and which partition owns each; no bytes are touched here.

    ``owner[s]`` is ``PENDING_SLAB`` until :meth:`mark_ready`, then ``FREE_SLAB`` or
    the id of the owning partition.
    """

    def __init__(self, size_bytes: int, slab_bytes: int) -> None:
        if slab_bytes <= 0 or size_bytes < slab_bytes:
            raise ValueError(
                f"pool of {size_bytes} bytes cannot hold one slab of {slab_bytes} bytes"
            )
        self.slab_bytes = slab_bytes
        self.n_slabs = size_bytes // slab_bytes
        self.owner = array("i", [PENDING_SLAB] * self.n_slabs)
        self._free: list[int] = []
        self.ready_slabs = 0

    @property
    def capacity_bytes(self) -> int:
        return self.n_slabs * self.slab_bytes

    @property
    def ready_bytes(self) -> int:
        return self.ready_slabs * self.slab_bytes

    @property
    def free_slabs(self) -> int:
        return len(self._free)

    def mark_ready(self, slab: int) -> None:
        """The engine finished preparing ``slab``; it may now be handed out."""
        assert self.owner[slab] == PENDING_SLAB, f"slab {slab} marked ready twice"
        self.owner[slab] = FREE_SLAB
        self.ready_slabs += 1
        self._free.append(slab)

    def take(self, partition_id: int) -> int | None:
        """A ready free slab for ``partition_id``, or ``None`` when there is none."""
        if not self._free:
            return None
        slab = self._free.pop()
        self.owner[slab] = partition_id
        return slab

    def give_back(self, slab: int) -> None:
        assert self.owner[slab] >= 0, f"slab {slab} is not owned"
        self.owner[slab] = FREE_SLAB
        self._free.append(slab)
