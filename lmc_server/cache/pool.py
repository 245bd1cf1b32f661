"""Partitions: fixed-size object slots with O(1) allocation. Private to the cache core.

A :class:`Partition` owns whole slabs of the :class:`~lmc_server.cache.slab_pool.SlabPool`,
serves one object layout (one fingerprint) and carves each of its slabs into
``slab_bytes // slot_stride(object_bytes, slab_bytes)`` equal slots, so there is no fragmentation
and allocation is a pop from a free list. Slots of large objects start on 4 KiB
boundaries where that costs no slot (:func:`~lmc_server.cache.slabs.slot_stride`):
slabs are page-aligned, so such a slot can be
written to disk with direct I/O straight from where it lies
(:mod:`lmc_server.tiers.disk.layout`). Nothing outside ``lmc_server/cache/`` imports this module
(``tests/project/test_layering.py``): the server and the tiers below L1 change slot states only
through :class:`~lmc_server.cache.index.L1Index`, so every transition keeps the
invariants below and the eviction order the index promises.

Slot states (``Partition.state``)::

    FREE --reserve--> WRITING --commit--> COMMITTED --evict/clear--> FREE
                         \\--abort-----------------------------------^
    any slot of a slab given back to the pool --> DEAD (until the slab returns)

Only ``COMMITTED`` slots are visible to lookups; only committed slots with no pins are
in the eviction policy. Invariants (checked by :meth:`Partition.check`):
``slot in policy`` iff ``state == COMMITTED and pins == 0``; every key in ``keys``
maps to a ``WRITING`` or ``COMMITTED`` slot whose ``slot_key`` is that key.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np

from lmc_server.cache.eviction.base import EvictionPolicy
from lmc_server.cache.slab_pool import SlabPool
from lmc_server.cache.slabs import slot_stride
from lmc_server.cache.watch import SlotWatcher

FREE, WRITING, COMMITTED, DEAD = 0, 1, 2, 3


class SlotSet:
    """Slots of one partition that are pinned and unpinned together, with what
    :meth:`Partition.pin_many` needs of them worked out once: their index array (in
    pin and in unpin order) and whether any slot appears twice. A retrieve plan that
    several identical retrieves share (:mod:`lmc_server.cache.retrieve`) pins its
    :class:`SlotSet` once for all of them; it is never changed after it is made."""

    __slots__ = ("slots", "idx", "back", "distinct")

    def __init__(self, slots: array) -> None:
        self.slots = slots
        idx = np.array(slots, dtype=np.int32)
        idx.flags.writeable = False
        self.idx = idx
        self.back = idx[::-1]
        self.distinct = idx.size < PIN_VECTOR_MIN or np.unique(idx).size == idx.size

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[int]:
        return iter(self.slots)


#: Below this many slots :meth:`Partition.pin_many` and ``unpin_many`` loop (numpy's
#: fixed cost is more than the loop's).
PIN_VECTOR_MIN = 16
#: Below this many slots :meth:`Partition.offsets` loops, for the same reason.
OFFSETS_VECTOR_MIN = 16


class Partition:
    """Object slots of one layout: a key table, slot states, pins and a policy.

    Slot ``i`` lives in segment ``i // slots_per_slab``; ``segments[seg]`` is the slab
    backing it (or -1 after the slab was given back). Per slot the partition keeps a
    handful of bytes in arrays and one reference to the key, so that 20,000 objects
    cost about a megabyte of Python heap.
    """

    def __init__(
        self,
        pid: int,
        fingerprint: bytes,
        name: str,
        object_bytes: int,
        pool: SlabPool,
        policy: EvictionPolicy,
    ) -> None:
        if object_bytes > pool.slab_bytes:
            raise ValueError(
                f"object group {name!r} objects are {object_bytes} bytes, larger than one "
                f"slab ({pool.slab_bytes} bytes); raise --slab-size-mb"
            )
        self.pid = pid
        self.fingerprint = fingerprint
        self.name = name
        self.object_bytes = object_bytes
        self.pool = pool
        self.policy = policy
        #: Bytes from one slot's start to the next (:func:`slot_stride`).
        self.stride = slot_stride(object_bytes, pool.slab_bytes)
        self.slots_per_slab = pool.slab_bytes // self.stride
        self.segments: list[int] = []
        #: ``segments`` as an int64 array for :meth:`offsets`, rebuilt after a change
        #: (slab moves are rare; offsets are computed on every request).
        self._segments_arr: np.ndarray | None = None
        self.keys: dict[bytes, int] = {}
        self.slot_key: list[bytes | None] = []
        self.state = array("b")
        self.pins = array("i")
        self.mask = array("B")
        self.tick = array("q")
        self._free: list[int] = []
        #: Bumped by every change of which key a committed slot holds (a commit, an
        #: eviction, an abort): a plan computed at one version reads the same objects
        #: while the version stands (:class:`~lmc_server.cache.retrieve.RetrievePlans`).
        self.version = 0
        self.n_committed = 0
        self.n_writing = 0
        #: Told of every commit and every eviction (the KV-event publisher); None: one
        #: attribute test per commit and eviction is all it costs.
        self.watcher: SlotWatcher | None = None
        policy.bind_keys(self.slot_key)

    # -- capacity -------------------------------------------------------------------

    @property
    def slabs(self) -> int:
        return sum(1 for s in self.segments if s >= 0)

    @property
    def capacity_objects(self) -> int:
        return self.slabs * self.slots_per_slab

    @property
    def used_bytes(self) -> int:
        return (self.n_committed + self.n_writing) * self.object_bytes

    def add_slab(self, slab: int) -> None:
        """Carve ``slab`` into slots, reusing a hole left by a given-back slab first."""
        sps = self.slots_per_slab
        try:
            seg = self.segments.index(-1)
            self.segments[seg] = slab
            self._segments_arr = None
        except ValueError:
            seg = len(self.segments)
            self.segments.append(slab)
            self._segments_arr = None
            n = sps
            self.slot_key.extend([None] * n)
            self.state.extend([DEAD] * n)
            self.pins.extend([0] * n)
            self.mask.extend([0] * n)
            self.tick.extend([0] * n)
            self.policy.grow(len(self.state))
        first = seg * sps
        for slot in range(first + sps - 1, first - 1, -1):
            assert self.state[slot] == DEAD
            self.state[slot] = FREE
            self._free.append(slot)

    def offsets(self, slots: np.ndarray | array) -> np.ndarray:
        """Byte offsets in the pool of the objects in ``slots`` (int64, in order)."""
        if len(slots) < OFFSETS_VECTOR_MIN:  # a few slots: numpy's fixed cost dominates
            sps, segments = self.slots_per_slab, self.segments
            slab_bytes, stride = self.pool.slab_bytes, self.stride
            out = []
            for s in slots.tolist() if isinstance(slots, np.ndarray) else slots:
                slab = segments[s // sps]
                assert slab >= 0, "a slot is in a released segment"
                out.append(slab * slab_bytes + s % sps * stride)
            return np.array(out, dtype=np.int64)
        if isinstance(slots, array):
            slots = np.frombuffer(slots, dtype=np.int32)
        seg, idx = np.divmod(slots.astype(np.int64), self.slots_per_slab)
        arr = self._segments_arr
        if arr is None:
            arr = self._segments_arr = np.asarray(self.segments, dtype=np.int64)
        slab = arr[seg]
        assert (slab >= 0).all(), "a slot is in a released segment"
        return slab * self.pool.slab_bytes + idx * self.stride

    # -- slot life cycle --------------------------------------------------------------

    def pop_free(self) -> int | None:
        """A free slot, or ``None``. Entries of given-back segments are skipped lazily."""
        while self._free:
            slot = self._free.pop()
            if self.state[slot] == FREE:
                return slot
        return None

    def reserve(self, key: bytes, slot: int, tick: int) -> None:
        """Bind a free ``slot`` to ``key`` in the WRITING state (invisible to lookups)."""
        assert self.state[slot] == FREE, f"slot {slot} is not free"
        assert key not in self.keys, "key already present"
        self.state[slot] = WRITING
        self.slot_key[slot] = key
        self.keys[key] = slot
        self.mask[slot] = 0
        self.tick[slot] = tick
        self.n_writing += 1

    def commit(self, slot: int, mask: int) -> None:
        """The copy into ``slot`` completed: make it visible and evictable."""
        assert self.state[slot] == WRITING, f"slot {slot} is not being written"
        self.state[slot] = COMMITTED
        self.mask[slot] = mask
        self.version += 1
        self.n_writing -= 1
        self.n_committed += 1
        if self.pins[slot] == 0:
            self.policy.admit(slot)
        if self.watcher is not None:
            key = self.slot_key[slot]
            assert key is not None
            self.watcher.visible(key)

    def abort(self, slot: int) -> None:
        """The copy into ``slot`` failed or its writer died: forget it entirely."""
        assert self.state[slot] == WRITING, f"slot {slot} is not being written"
        assert self.pins[slot] == 0, "a slot being written cannot be pinned"
        self.n_writing -= 1
        self._release(slot)

    def evict(self, slot: int) -> None:
        """Drop a committed, unpinned object (its slot becomes free)."""
        assert self.state[slot] == COMMITTED and self.pins[slot] == 0
        if self.watcher is not None:
            key = self.slot_key[slot]
            assert key is not None
            self.watcher.gone(key)
        self.policy.forget(slot)
        self.n_committed -= 1
        self._release(slot)

    def _release(self, slot: int) -> None:
        key = self.slot_key[slot]
        assert key is not None
        del self.keys[key]
        self.slot_key[slot] = None
        self.state[slot] = FREE
        self.version += 1
        self._free.append(slot)

    def pin(self, slot: int) -> None:
        assert self.state[slot] == COMMITTED, f"pinning slot {slot} that is not committed"
        if self.pins[slot] == 0:
            self.policy.pin(slot)
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        assert self.pins[slot] > 0, f"unpinning slot {slot} that is not pinned"
        self.pins[slot] -= 1
        if self.pins[slot] == 0 and self.state[slot] == COMMITTED:
            self.policy.unpin(slot)

    def pin_many(self, slots: array | SlotSet) -> None:
        """:meth:`pin` each of ``slots`` (committed) in one pass: the ones pinned for the
        first time leave the eviction order in one :meth:`pin_run`. A list with a slot
        twice (a request naming a chunk twice) goes slot by slot."""
        ss = slots if isinstance(slots, SlotSet) else SlotSet(slots)
        idx = ss.idx
        if idx.size < PIN_VECTOR_MIN or not ss.distinct:
            for s in ss.slots:
                self.pin(s)
            return
        assert (np.frombuffer(self.state, dtype=np.int8)[idx] == COMMITTED).all(), (
            "pinning a slot that is not committed"
        )
        pins = np.frombuffer(self.pins, dtype=np.int32)
        before = pins[idx]
        pins[idx] = before + 1
        if before.all():  # pinned already (an identical retrieve in flight)
            return
        first = idx[before == 0]
        self.policy.pin_run(first.tolist())

    def unpin_many(self, slots: array | SlotSet) -> None:
        """:meth:`unpin` each of ``slots`` in one pass, last to first (so the first,
        chunk 0 of a prefix, ends most recent), as one :meth:`unpin_run`."""
        ss = slots if isinstance(slots, SlotSet) else SlotSet(slots)
        idx = ss.back
        if idx.size < PIN_VECTOR_MIN or not ss.distinct:
            for s in reversed(ss.slots):
                self.unpin(s)
            return
        pins = np.frombuffer(self.pins, dtype=np.int32)
        before = pins[idx]
        assert (before > 0).all(), "unpinning a slot that is not pinned"
        pins[idx] = before - 1
        last = before == 1
        if not last.any():  # still pinned by another reader
            return
        back = idx[last & (np.frombuffer(self.state, dtype=np.int8)[idx] == COMMITTED)]
        if back.size:
            self.policy.unpin_run(back.tolist())

    def touch_prefix(self, slots: array, tick: int) -> None:
        """Touch the objects of one prefix's chunks, ``slots`` in chunk order (chunks
        ``0..k-1`` for a hit; those a store found committed), ending with the first
        (the most recent: every longer hit needs it). Vectorized tick update."""
        if not slots:
            return
        idx = np.frombuffer(slots, dtype=np.int32)
        np.frombuffer(self.tick, dtype=np.int64)[idx] = tick
        pins = np.frombuffer(self.pins, dtype=np.int32)[idx]
        if pins.any():
            evictable = [s for s, p in zip(slots, pins.tolist(), strict=True) if p == 0]
            evictable.reverse()
            self.policy.touch_run(evictable)
        else:  # the slots reversed, as a list and as the array the LRU reads
            back = idx[::-1]
            self.policy.touch_run(back.tolist(), back)

    # -- giving slabs back --------------------------------------------------------------

    def releasable_segment(self, slot: int, colder_than: float) -> int | None:
        """The segment of ``slot`` if it can be given back without evicting anything
        pinned, being written, or used at or after tick ``colder_than``."""
        seg = slot // self.slots_per_slab
        first = seg * self.slots_per_slab
        for s in range(first, first + self.slots_per_slab):
            st = self.state[s]
            if st == WRITING or self.pins[s]:
                return None
            if st == COMMITTED and self.tick[s] >= colder_than:
                return None
        return seg

    def release_segment(self, seg: int) -> tuple[int, int]:
        """Evict every object of segment ``seg`` and give its slab back to the pool.

        Returns ``(objects evicted, bytes evicted)``.
        """
        first = seg * self.slots_per_slab
        evicted = 0
        for s in range(first, first + self.slots_per_slab):
            if self.state[s] == COMMITTED:
                self.evict(s)
                evicted += 1
            assert self.state[s] == FREE, f"slot {s} busy in a released segment"
            self.state[s] = DEAD
        slab = self.segments[seg]
        self.segments[seg] = -1
        self._segments_arr = None
        self.pool.give_back(slab)
        return evicted, evicted * self.object_bytes

    def check(self) -> None:
        """Assert every invariant in the module docstring (tests; O(slots))."""
        writing = committed = 0
        for s, st in enumerate(self.state):
            evictable = st == COMMITTED and self.pins[s] == 0
            assert (s in self.policy) == evictable, f"slot {s}: policy membership wrong"
            if st in (WRITING, COMMITTED):
                key = self.slot_key[s]
                assert key is not None and self.keys.get(key) == s, f"slot {s}: key table"
                writing += st == WRITING
                committed += st == COMMITTED
            else:
                assert self.pins[s] == 0, f"slot {s}: pinned while {st}"
        assert writing == self.n_writing and committed == self.n_committed
        assert len(self.keys) == writing + committed
