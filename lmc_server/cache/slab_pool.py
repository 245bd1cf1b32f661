"""The slab pool: which slabs of the L1 pool are ready, and which partition owns each.
Private to the cache core.

The L1 pool (one large host allocation owned by the transfer engine) is carved into
``slab_bytes`` slabs. A slab is pending until the engine has made it usable (pinned or
populated, in the background), then free, then owned by exactly one partition, which
carves it into equal object slots (:mod:`lmc_server.cache.pool`). The index builds the
one :class:`SlabPool` of a server and is the only door to it
(:class:`~lmc_server.cache.index.L1Index`: ``slab_ready`` as the engine reports slabs,
``pool_usage`` for what it holds); nothing outside ``lmc_server/cache/`` imports this
module (``tests/project/test_layering.py``). No bytes are touched here.
"""

from __future__ import annotations

from array import array

PENDING_SLAB = -2
FREE_SLAB = -1


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
