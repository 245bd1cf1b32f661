"""The L1 index: the one object the server, the L2 tier and the tests drive.

One :class:`L1Index` per server, driven from the event-loop thread only. It owns the
slab pool (it builds it: ``slab_ready`` as the engine prepares each slab, ``pool_usage``
and ``slab_bytes`` for the rest of the server), the partitions, namespaces, leases,
counters and the index clock (``tick``: one step per request, the age every eviction
and donation decision compares), and delegates each job to its module:

* keys: :mod:`lmc_server.cache.keys` (namespace, digest and salt to key);
* the hit rule: :mod:`lmc_server.cache.view` over one retention object per section kind
  (:mod:`lmc_server.cache.retention`);
* allocation and slab donation between partitions: :mod:`lmc_server.cache.allocator`;
* store reservation (``reserve_store`` then ``commit_store`` or ``abort_store``):
  :mod:`lmc_server.cache.store`, so a half-written object is never visible;
* retrieve pinning (``pin_retrieve`` then ``unpin_retrieve``):
  :mod:`lmc_server.cache.retrieve`, so an object being read is never evicted;
* the tiers below L1: a prefetch's slots (``reserve_fill`` then ``finish_fill``) are
  the same :class:`~lmc_server.cache.reservation.Reservation` a store holds, committed
  from the last chunk to the first the same way; the write-behind pins each object for
  its read (``pin_object`` / ``unpin_object``);
* a store's wait for another writer: ``settle_in_progress``;
* the KV-event publisher's watch on a partition: ``watch``;
* what each partition holds, for the report and the gauges: ``usage``; what the slab
  pool holds: ``pool_usage``.

This is the only door into L1's slot and slab states: nothing outside
``lmc_server/cache/`` imports the slab pool (:mod:`lmc_server.cache.slab_pool`), the
partitions (:mod:`lmc_server.cache.pool`) or the modules that change them
(``tests/project/test_layering.py``), and a :class:`~lmc_server.cache.view.CacheView` keeps its
partitions to the core (``_partitions``).

It never copies bytes. A lookup reports the longest hit prefix and may take a lease that
pins exactly the objects a retrieve of that prefix reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from lmc_server.cache import reservation, retrieve, store
from lmc_server.cache.allocator import SlotAllocator
from lmc_server.cache.counters import CacheStats
from lmc_server.cache.eviction.registry import make_policy
from lmc_server.cache.keys import chunk_keys, namespace_prefix
from lmc_server.cache.layout import ObjectGroupLayout, RegistrationLayout
from lmc_server.cache.leases import Lease, LeaseTable
from lmc_server.cache.pool import Partition
from lmc_server.cache.reservation import Reservation
from lmc_server.cache.retrieve import RetrievePlans, RetrieveTicket
from lmc_server.cache.slab_pool import SlabPool
from lmc_server.cache.status import ChunkStatus
from lmc_server.cache.store import StoreTicket
from lmc_server.cache.usage import PartitionUsage, PoolUsage, usage_of
from lmc_server.cache.view import CacheView, hit_chunks, needed_slots, prompt_hits
from lmc_server.cache.watch import SlotWatcher

#: Distinct registration layouts interned by :meth:`L1Index.view` (a bound on what a
#: client registering ever new geometries can make the index keep).
LAYOUTS_MAX = 1024

__all__ = [
    "L1Index",
    "Lease",
    "PartitionUsage",
    "PoolUsage",
    "Reservation",
    "RetrieveTicket",
    "StoreTicket",
]


class L1Index:
    """The slab pool, partitions, namespaces, leases and counters of the whole L1 tier.

    ``size_bytes`` of pool (whole ``slab_bytes`` slabs of it; a pool without room for
    one slab is refused with ``ValueError``), every slab pending until
    :meth:`slab_ready`; ``policy`` names the eviction policy of every partition.
    """

    def __init__(self, size_bytes: int, slab_bytes: int, policy: str = "LRU") -> None:
        make_policy(policy)  # validate the name early
        self._pool = pool = SlabPool(size_bytes, slab_bytes)
        self.policy_name = policy
        self._partitions: dict[bytes, Partition] = {}
        self._namespaces: dict[str, int] = {}
        self._leases = LeaseTable()
        self.stats = CacheStats()
        self.tick = 0
        self._allocator = SlotAllocator(pool, self._partitions, self.stats)
        #: One layout object per distinct geometry (see :meth:`view`), at most
        #: :data:`LAYOUTS_MAX`; past that, new geometries keep their own.
        self._layouts: dict[tuple[object, ...], RegistrationLayout] = {}
        #: The plans identical retrieves share (:class:`~lmc_server.cache.retrieve.RetrievePlans`).
        self.retrieve_plans = RetrievePlans(counts=self.stats.retrieve_plans)

    # -- registration -----------------------------------------------------------------

    def view(self, namespace: str, layout: RegistrationLayout) -> CacheView:
        """Intern ``namespace`` and get (or create) a partition per object group.

        The layout is interned by value too: registrations of one geometry (the ranks
        of a tensor-parallel engine) get one layout object, so that a retrieve one of
        them sends is recognised by identity as the one another just sent
        (:class:`~lmc_server.cache.retrieve.RetrievePlans`)."""
        ns_id = self._namespaces.setdefault(namespace, len(self._namespaces) + 1)
        lkey = (layout.chunk_size, layout.object_groups, tuple(sorted(layout.windows.items())))
        known = self._layouts.get(lkey)
        if known is not None:
            layout = known
        elif len(self._layouts) < LAYOUTS_MAX:
            self._layouts[lkey] = layout
        parts = tuple(self._partition(og) for og in layout.object_groups)
        return CacheView(ns_prefix=namespace_prefix(ns_id), layout=layout, _partitions=parts)

    def _partition(self, og: ObjectGroupLayout) -> Partition:
        part = self._partitions.get(og.fingerprint)
        if part is None:
            part = Partition(
                len(self._partitions),
                og.fingerprint,
                og.name,
                og.object_bytes,
                self._pool,
                make_policy(self.policy_name),
            )
            self._partitions[og.fingerprint] = part
        return part

    def watch(self, view: CacheView, og_index: int, watcher: SlotWatcher) -> None:
        """Tell ``watcher`` of every object of object group ``og_index`` of ``view`` (of
        every namespace sharing its partition) that becomes visible or goes; one watcher
        per partition, the last one set."""
        view._partitions[og_index].watcher = watcher

    def keys(self, view: CacheView, digests: bytes, salt: bytes = b"") -> list[bytes]:
        """The index keys of a run of chunk digests (:func:`~lmc_server.cache.keys.chunk_keys`)."""
        return chunk_keys(view.ns_prefix, digests, salt)

    # -- lookup -------------------------------------------------------------------------

    def lookup(
        self,
        view: CacheView,
        keys: list[bytes],
        owner: int,
        lease_ttl_s: float,
        now_s: float,
        take_lease: bool = True,
    ) -> tuple[int, Lease | None]:
        """Longest hit prefix (in chunks) and, if asked and non-empty, a lease on it."""
        self.tick += 1
        k, slots = hit_chunks(view, keys)
        stats, chunk_size = self.stats, view.layout.chunk_size
        stats.lookups += 1
        stats.lookup_chunks += len(keys)
        stats.hit_chunks += k
        stats.lookup_tokens += len(keys) * chunk_size
        stats.hit_tokens += k * chunk_size
        if k == 0:
            return 0, None
        pins = needed_slots(view, slots, k)
        for part, ss in pins:
            part.touch_prefix(ss, self.tick)
        if not take_lease:
            return k, None
        self.stats.leases_taken += 1
        return k, self._leases.take(owner, now_s + lease_ttl_s, k, pins)

    def probe(self, view: CacheView, keys: list[bytes], ends: list[int]) -> list[int]:
        """Longest hit prefix (in chunks) of each prompt ``keys[ends[i-1]:ends[i]]``, for
        a router's probe: no lease, no touch (a probe is not a use, so it leaves the
        eviction order alone), counted apart from lookups so hit rates stay the
        engines'."""
        hits = prompt_hits(view, keys, ends)
        stats, chunk_size = self.stats, view.layout.chunk_size
        stats.probes += len(ends)
        stats.probe_tokens += len(keys) * chunk_size
        stats.probe_hit_tokens += sum(hits) * chunk_size
        return hits

    # -- the tiers below L1 ----------------------------------------------------------------

    def missing(
        self, view: CacheView, og_index: int, keys: list[bytes], chunks: Iterable[int]
    ) -> list[int]:
        """The chunks (indices into ``keys``) whose object of object group ``og_index``
        L1 holds neither committed nor being written."""
        held = view._partitions[og_index].keys
        return [i for i in chunks if keys[i] not in held]

    def reserve_fill(
        self,
        view: CacheView,
        keys: list[bytes],
        wanted: Mapping[int, tuple[Iterable[int], Iterable[int]]],
    ) -> tuple[list[Reservation], dict[int, list[int]]]:
        """WRITING slots for objects the caller copies in itself (an L2 prefetch), one
        step of the index clock (:func:`~lmc_server.cache.reservation.reserve_fill`).
        The caller ends each reservation with :meth:`finish_fill`."""
        self.tick += 1
        return reservation.reserve_fill(view, keys, wanted, self._allocator, self.tick)

    def finish_fill(self, r: Reservation, ok: Sequence[bool]) -> Reservation:
        """Commit the filled objects whose copy was verified (``ok[j]``), abort the
        rest, last chunk first; returns the committed ones."""
        return reservation.finish(r, ok)

    def pin_object(self, r: Reservation, j: int) -> tuple[int, int] | None:
        """Pin committed object ``j`` of ``r`` for a read (the L2 write-behind): its
        (pool offset, section mask), or None when it was evicted since."""
        return reservation.pin_object(r, j)

    def unpin_object(self, r: Reservation, j: int) -> None:
        reservation.unpin_object(r, j)

    # -- store and retrieve -------------------------------------------------------------

    def reserve_store(
        self, view: CacheView, keys: list[bytes], group_ids: dict[int, np.ndarray]
    ) -> StoreTicket:
        """Reserve a WRITING slot for every storable (object group, chunk)
        (:func:`~lmc_server.cache.store.reserve_store`)."""
        self.tick += 1
        return store.reserve_store(view, keys, group_ids, self._allocator, self.tick, self.stats)

    def commit_store(self, ticket: StoreTicket) -> None:
        """The copy completed: every reserved object becomes visible."""
        store.commit_store(ticket, self.stats)

    def abort_store(self, ticket: StoreTicket) -> None:
        """The copy failed or its writer is gone: free every reserved slot."""
        store.abort_store(ticket, self.stats)

    def settle_in_progress(
        self, view: CacheView, keys: list[bytes], statuses: list[np.ndarray]
    ) -> int:
        """Settle a store's ``IN_PROGRESS`` chunks whose other writer finished (in
        place); how many are still being written
        (:func:`~lmc_server.cache.store.settle_in_progress`)."""
        return store.settle_in_progress(view, keys, statuses)

    def pin_retrieve(
        self,
        view: CacheView,
        keys: list[bytes],
        group_ids: dict[int, np.ndarray],
        prefix_ends: list[int] | None = None,
        plan_key: tuple[object, ...] | None = None,
    ) -> RetrieveTicket:
        """Pin what a retrieve of these chunks reads
        (:func:`~lmc_server.cache.retrieve.pin_retrieve`; ``plan_key``: what identifies
        the request if the caller knows, see there)."""
        self.tick += 1
        return retrieve.pin_retrieve(
            view, keys, group_ids, prefix_ends, self.tick, self.retrieve_plans, plan_key
        )

    def unpin_retrieve(self, ticket: RetrieveTicket, ok: bool) -> None:
        """The copy finished (or failed: every pinned chunk then reports FAILED)."""
        retrieve.unpin_retrieve(ticket, ok, self.stats)

    # -- leases and housekeeping -----------------------------------------------------------

    def release(self, lease_id: int) -> bool:
        released = self._leases.release(lease_id) is not None
        self.stats.leases_released += released
        return released

    def expire_leases(self, now_s: float) -> int:
        n = len(self._leases.expire(now_s))
        self.stats.leases_expired += n
        return n

    def drop_owner(self, owner: int) -> int:
        """Release the leases of a session that went away."""
        n = self._leases.release_owner(owner)
        self.stats.leases_released += n
        return n

    def clear(self) -> int:
        """Evict every committed, unpinned object; give fully free slabs back."""
        n = 0
        for part in self._partitions.values():
            while (v := part.policy.peek()) is not None:
                part.evict(v)
                n += 1
            for seg, slab in enumerate(part.segments):
                if slab < 0:
                    continue
                first = seg * part.slots_per_slab
                if all(part.state[s] == 0 for s in range(first, first + part.slots_per_slab)):
                    part.release_segment(seg)
        return n

    # -- the slab pool -----------------------------------------------------------------

    def slab_ready(self, slab: int) -> None:
        """The engine finished preparing ``slab`` (paged in or pinned): it may now be
        handed to a partition. Each slab once, in any order."""
        self._pool.mark_ready(slab)

    @property
    def any_slab_ready(self) -> bool:
        """Whether a store can be placed at all: False only while the engine has not
        prepared the first slab (a server that just started)."""
        return self._pool.ready_slabs > 0

    def awaits_a_slab(self, view: CacheView, ticket: StoreTicket) -> bool:
        """Whether ``ticket`` found no room (``NO_SPACE``) for an object group whose
        partition holds no slab yet, while slabs of the pool are still being prepared:
        a server that just started, where the same store a moment later finds room.
        Once a partition has slabs, ``NO_SPACE`` means they are all pinned or being
        written, which asking again soon does not cure: answered as before. (Should
        preparing stop early, a slab failing to pin, a slab-less partition is placed as
        soon as any slab is free of pins and writers: the allocator gives one to a
        partition with nothing to evict.)"""
        pool = self._pool
        if pool.ready_slabs == pool.n_slabs:
            return False
        for st, part in zip(ticket.statuses, view._partitions, strict=True):
            if part.slabs == 0 and bool((st == ChunkStatus.NO_SPACE).any()):
                return True
        return False

    @property
    def slab_bytes(self) -> int:
        """The size of one slab: the largest object a partition can hold."""
        return self._pool.slab_bytes

    def pool_usage(self) -> PoolUsage:
        """How many slabs the pool has, how many are prepared and free (safe to call
        from another thread)."""
        pool = self._pool
        return PoolUsage(
            slab_bytes=pool.slab_bytes,
            slabs=pool.n_slabs,
            ready_slabs=pool.ready_slabs,
            free_slabs=pool.free_slabs,
        )

    # -- reporting ---------------------------------------------------------------------

    def usage(self) -> list[PartitionUsage]:
        """Capacity and use of every partition (safe to call from another thread)."""
        return [usage_of(p) for p in list(self._partitions.values())]

    @property
    def lease_count(self) -> int:
        """Leases alive (taken, not yet released or expired)."""
        return len(self._leases)

    @property
    def used_bytes(self) -> int:
        """Bytes of committed and being-written objects in L1."""
        return sum(p.used_bytes for p in list(self._partitions.values()))

    def check(self) -> None:
        """Every partition's invariants, and pins == lease pins + in-flight reads."""
        for part in self._partitions.values():
            part.check()
