"""Slots for a partition: its free list, new slabs, a colder partition's slab, eviction.

The pool is shared by every partition (one per object layout), and a slab once carved
serves one partition until it is given back. When the pool has no free slab left, a
partition that needs room either evicts its own coldest objects or takes a whole slab
from a partition whose objects are much colder (slab donation), so a layout that stopped
being used does not keep its share of the pool forever.

Donation rule (:meth:`SlotAllocator.alloc`): another partition gives a slab only if its
coldest object is at least ``DONOR_AGE_RATIO`` times older (in index ticks) than the
taker's own victim, and every object in that slab was last used before the taker's
victim: moving a slab never evicts anything hotter than plain eviction in the taker
would. A slab holding a pinned object or one being written is never moved
(:meth:`~lmc_server.cache.pool.Partition.releasable_segment`). A partition with nothing
to evict (new, or all pinned) takes any slab free of pins and writers.
"""

from __future__ import annotations

import math

from lmc_server.cache.counters import CacheStats
from lmc_server.cache.pool import Partition
from lmc_server.cache.slab_pool import SlabPool

#: How many of another partition's coldest objects are tried as the way to a slab it
#: could give back (the slab holding one of them must hold nothing hotter).
DONOR_CANDIDATES = 8
#: A partition gives a slab to another only if its coldest object is at least this many
#: times older (in index ticks) than the other's own victim.
DONOR_AGE_RATIO = 2


class SlotAllocator:
    """Hands out free slots of one partition, moving slabs between ``partitions``.

    ``partitions`` is the index's own table (partitions registered later take part);
    evictions and slab moves are counted in ``stats``.
    """

    def __init__(
        self, pool: SlabPool, partitions: dict[bytes, Partition], stats: CacheStats
    ) -> None:
        self.pool = pool
        self.partitions = partitions
        self.stats = stats

    def alloc(self, part: Partition, m: int, tick: int) -> list[int]:
        """Up to ``m`` free slots of ``part`` (now ``tick``): free list, new slabs, a
        colder partition's slab, own victims; fewer only when nothing else can be evicted.

        Once no partition qualifies as a donor, the rest of the batch evicts in ``part``
        without asking again (the donors' ages do not change within one request).
        """
        out: list[int] = []
        donors_tried = False
        while len(out) < m:
            slot = part.pop_free()
            if slot is not None:
                out.append(slot)
                continue
            slab = self.pool.take(part.pid)
            if slab is not None:
                part.add_slab(slab)
                continue
            if not donors_tried:
                if self.take_donor_slab(part, tick):
                    continue
                donors_tried = True
            own = part.policy.peek()
            if own is None:
                break
            part.evict(own)
            self.stats.evictions += 1
            self.stats.evicted_bytes += part.object_bytes
        return out

    def take_donor_slab(self, part: Partition, tick: int) -> bool:
        """Move a slab from a much colder partition to ``part``; whether one moved."""
        own = part.policy.peek()
        own_tick = part.tick[own] if own is not None else math.inf
        # Only a partition whose coldest object is much older than ours is worth a look:
        # partitions written in step (full and window objects of the same chunks) age
        # alike, and scanning their slabs on every eviction would be wasted work.
        donor_tick = tick - DONOR_AGE_RATIO * (tick - own_tick) if own is not None else math.inf
        donor: tuple[Partition, int] | None = None
        for other in self.partitions.values():
            if other is part:
                continue
            for v in other.policy.first(DONOR_CANDIDATES):
                if other.tick[v] >= donor_tick:
                    break
                seg = other.releasable_segment(v, colder_than=own_tick)
                if seg is not None:
                    donor, donor_tick = (other, seg), other.tick[v]
                    break
        if donor is None:
            return False
        n, nbytes = donor[0].release_segment(donor[1])
        self.stats.evictions += n
        self.stats.evicted_bytes += nbytes
        self.stats.slabs_moved += 1
        slab = self.pool.take(part.pid)
        assert slab is not None, "a released slab went back to the pool"
        part.add_slab(slab)
        return True
