"""The eviction-policy interface and the two data structures the policies share.

A policy orders only *evictable* slots: committed and not pinned by a lease or an
in-flight read. The partition tells it every transition, so :meth:`pop_victim` never has
to skip over pinned objects:

    admit  -- a new object was committed (evictable, and unpinned)
    pin    -- an evictable object got its first pin (no longer evictable)
    unpin  -- a pinned object lost its last pin (evictable again)
    touch  -- an evictable object was used
    forget -- an evictable object is being dropped (evicted, cleared)

Policies that remember evicted objects (ghost entries: ARC, S3-FIFO, SARC) need to
know *which* object a slot held, since a slot is reused for other keys; the partition
hands them its slot-to-key table once through :meth:`EvictionPolicy.bind_keys`.

Shared structures, all in flat ``array`` columns indexed by slot (no Python object per
slot or per operation, O(1) per call):

- :class:`SlotLists`: several doubly linked lists threaded through one pair of arrays;
  a slot is in at most one list.
- :class:`GhostTags`: a direct-mapped table of 32-bit key tags that remembers recently
  evicted keys in 4 bytes each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

NIL = -1
_MASK64 = (1 << 64) - 1


class EvictionPolicy(ABC):
    """Orders evictable slots ``0 <= slot < capacity`` by how soon to evict them."""

    name: ClassVar[str]
    #: One line for ``--help``: what the policy evicts first.
    summary: ClassVar[str] = ""

    @abstractmethod
    def grow(self, capacity: int) -> None:
        """Allow slots up to ``capacity - 1``; capacity never shrinks."""

    @abstractmethod
    def admit(self, slot: int) -> None:
        """A new object in ``slot`` became evictable. ``slot`` must not be present."""

    @abstractmethod
    def pin(self, slot: int) -> None:
        """``slot`` stops being evictable (first pin). Must be present."""

    @abstractmethod
    def unpin(self, slot: int) -> None:
        """``slot`` is evictable again (last pin released). Must not be present."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """``slot`` was used while evictable. Must be present."""

    @abstractmethod
    def forget(self, slot: int) -> None:
        """``slot``'s object is dropped by the caller. Must be present."""

    @abstractmethod
    def pop_victim(self) -> int | None:
        """Remove and return the slot to evict first, or ``None`` when empty."""

    @abstractmethod
    def peek(self) -> int | None:
        """The slot :meth:`pop_victim` would return, without removing it.

        A policy may reorder its internal queues here (S3-FIFO moves re-used objects
        on); membership never changes.
        """

    def bind_keys(self, slot_key: Sequence[bytes | None]) -> None:
        """The partition's slot-to-key table (read only; the partition keeps it filled
        for every WRITING or COMMITTED slot). Policies without ghosts ignore it."""
        return None

    def touch_run(self, slots: list[int], run: np.ndarray | None = None) -> None:
        """Touch ``slots`` in this order (all present, distinct). ``run``: the same
        slots as an int32 array, where the caller has one (a policy that works on
        arrays reads it instead of converting ``slots``)."""
        for s in slots:
            self.touch(s)

    def pin_run(self, slots: list[int]) -> None:
        """:meth:`pin` each of ``slots`` in this order (all present, distinct)."""
        for s in slots:
            self.pin(s)

    def unpin_run(self, slots: list[int]) -> None:
        """:meth:`unpin` each of ``slots`` in this order (none present, distinct)."""
        for s in slots:
            self.unpin(s)

    def first(self, k: int) -> list[int]:
        """Up to ``k`` slots from the front of the order (at least :meth:`peek`'s)."""
        v = self.peek()
        return [] if v is None else [v]

    @abstractmethod
    def __contains__(self, slot: int) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


class SlotLists:
    """``n_lists`` doubly linked lists of slots threaded through shared int32 arrays.

    ``where[slot]`` is the list holding ``slot`` (1-based) or 0. Head = oldest end
    (evicted first), tail = newest. Invariant: following ``nxt`` from ``head[l]`` visits
    exactly the slots with ``where == l``, ``size[l]`` of them, ending at ``tail[l]``.
    9 bytes per slot.
    """

    __slots__ = ("prev", "nxt", "where", "head", "tail", "size")

    def __init__(self, n_lists: int) -> None:
        self.prev = array("i")
        self.nxt = array("i")
        self.where = array("b")
        self.head = [NIL] * (n_lists + 1)
        self.tail = [NIL] * (n_lists + 1)
        self.size = [0] * (n_lists + 1)

    def grow(self, capacity: int) -> None:
        extra = capacity - len(self.where)
        if extra > 0:
            self.prev.extend([NIL] * extra)
            self.nxt.extend([NIL] * extra)
            self.where.extend([0] * extra)

    def push(self, lst: int, slot: int) -> None:
        """Append ``slot`` (in no list) at the tail of ``lst``."""
        assert not self.where[slot], f"slot {slot} is already in list {self.where[slot]}"
        t = self.tail[lst]
        self.prev[slot] = t
        self.nxt[slot] = NIL
        if t == NIL:
            self.head[lst] = slot
        else:
            self.nxt[t] = slot
        self.tail[lst] = slot
        self.where[slot] = lst
        self.size[lst] += 1

    def unlink(self, slot: int) -> int:
        """Remove ``slot`` from its list; returns that list."""
        lst = self.where[slot]
        assert lst, f"slot {slot} is in no list"
        p, n = self.prev[slot], self.nxt[slot]
        if p == NIL:
            self.head[lst] = n
        else:
            self.nxt[p] = n
        if n == NIL:
            self.tail[lst] = p
        else:
            self.prev[n] = p
        self.where[slot] = 0
        self.size[lst] -= 1
        return lst

    def move(self, lst: int, slot: int) -> None:
        """Move ``slot`` (in some list) to the tail of ``lst``."""
        if self.tail[lst] != slot:
            self.unlink(slot)
            self.push(lst, slot)

    def items(self, lst: int) -> list[int]:
        """Slots of ``lst`` from head to tail (tests and :meth:`EvictionPolicy.first`)."""
        out = []
        s = self.head[lst]
        while s != NIL:
            out.append(s)
            s = self.nxt[s]
        return out


class GhostTags:
    """Recently evicted keys, remembered as 32-bit tags in a direct-mapped table.

    A key's 64-bit hash picks a cell (low bits) and a tag (high 32 bits, never 0).
    Recording overwrites whatever the cell held, so an entry lives until a later key
    maps to its cell: about ``cells`` recordings on average, like a FIFO of that length
    with random instead of strict order. 4 bytes per remembered key and O(1) per call,
    against ~100 bytes for a dict entry; a false "seen" needs the same cell and the same
    32-bit tag. ``size`` counts occupied cells (ARC compares ghost list sizes).
    """

    __slots__ = ("_cells", "_mask", "size")

    def __init__(self) -> None:
        self._cells = array("I")
        self._mask = -1
        self.size = 0

    def grow(self, capacity: int) -> None:
        """Hold about ``capacity`` keys (rounded up to a power of two). Growing starts
        an empty table: a cell is a function of the table size, and forgetting ghosts
        while the pool is still filling costs nothing (nothing was evicted yet)."""
        if capacity <= len(self._cells):
            return
        n = 1 << max(4, (capacity - 1).bit_length())
        self._cells = array("I", bytes(4 * n))
        self._mask = n - 1
        self.size = 0

    @staticmethod
    def _split(key: bytes) -> tuple[int, int]:
        h = hash(key) & _MASK64
        return h, (h >> 32) or 1

    def add(self, key: bytes) -> None:
        if self._mask < 0:
            return
        h, tag = self._split(key)
        cell = h & self._mask
        if not self._cells[cell]:
            self.size += 1
        self._cells[cell] = tag

    def pop(self, key: bytes) -> bool:
        """Whether ``key`` is remembered; forgets it if so."""
        if self._mask < 0:
            return False
        h, tag = self._split(key)
        cell = h & self._mask
        if self._cells[cell] != tag:
            return False
        self._cells[cell] = 0
        self.size -= 1
        return True


_HALVE = bytes(i >> 1 for i in range(256))


class FrequencySketch:
    """How often each key was seen lately: a count-min sketch of 8-bit counters.

    Two cells per key (from the low and high halves of its 64-bit hash) in one table;
    the estimate is the smaller of the two, and an increment raises only the cells at
    that minimum (conservative update), so a collision can only overestimate. Every
    ``len(cells)`` increments all counters are halved (one C-level ``bytes.translate``),
    so a key's count decays with a half-life of about one table of traffic and old
    popularity fades. One byte per cell; O(1) per call, amortized.
    """

    __slots__ = ("_cells", "_mask", "_ops")

    MAX = 255

    def __init__(self) -> None:
        self._cells = bytearray()
        self._mask = -1
        self._ops = 0

    def grow(self, cells: int) -> None:
        """Hold ``cells`` rounded *down* to a power of two counters (so a budget in
        bytes per slot holds); growing restarts the counts."""
        n = 1 << max(4, cells.bit_length() - 1)
        if n <= len(self._cells):
            return
        self._cells = bytearray(n)
        self._mask = n - 1
        self._ops = 0

    def _cells_of(self, key: bytes) -> tuple[int, int]:
        h = hash(key) & _MASK64
        return h & self._mask, (h >> 32) & self._mask

    def estimate(self, key: bytes) -> int:
        if self._mask < 0:
            return 0
        a, b = self._cells_of(key)
        return min(self._cells[a], self._cells[b])

    def add(self, key: bytes) -> int:
        """Count one more sighting of ``key``; returns the estimate before it."""
        if self._mask < 0:
            return 0
        cells = self._cells
        a, b = self._cells_of(key)
        ca, cb = cells[a], cells[b]
        low = min(ca, cb)
        if low < self.MAX:
            if ca == low:
                cells[a] = low + 1
            if cb == low:
                cells[b] = low + 1
        self._ops += 1
        if self._ops >= len(cells):
            self._ops = 0
            self._cells = bytearray(bytes(cells).translate(_HALVE))
        return low
