"""LRU, the default eviction policy: an intrusive doubly linked list over slot indices.

Callers touch, admit and unpin the chunks of one prefix from the last chunk to the first,
so that chunk 0 (which every longer hit needs) is the most recent of its prefix; runs of
a prefix are moved with numpy when they are long (:data:`_VECTOR_MIN`).
"""

from __future__ import annotations

from array import array

import numpy as np

from lmc_server.cache.eviction.base import NIL as _NIL
from lmc_server.cache.eviction.base import EvictionPolicy
from lmc_server.cache.eviction.names import SUMMARIES

#: Runs at least this long are checked for contiguity with numpy (measured: 8 us instead
#: of 14 us for a 256-chunk prefix on the development host).
_VECTOR_MIN = 16


class LRUPolicy(EvictionPolicy):
    """Least recently used first; a lookup, a retrieve, a released lease and a store of a
    chunk already held are uses.

    A doubly linked list threaded through two int32 arrays, head = evict first. Hand-made
    rather than an ``OrderedDict`` so that membership costs 9 bytes per slot and no
    Python object is allocated per operation. Invariant: ``slot in self`` iff
    ``self._in[slot]``, and the list from ``_head`` following ``_next`` visits exactly
    those slots, ending at ``_tail``.
    """

    name = "LRU"
    summary = SUMMARIES[name]

    def __init__(self, capacity: int = 0) -> None:
        self._prev = array("i")
        self._next = array("i")
        self._in = array("b")
        self._head = _NIL
        self._tail = _NIL
        self._len = 0
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        extra = capacity - len(self._in)
        if extra > 0:
            self._prev.extend([_NIL] * extra)
            self._next.extend([_NIL] * extra)
            self._in.extend([0] * extra)

    def _append(self, slot: int) -> None:
        assert not self._in[slot], f"slot {slot} is already in the LRU order"
        self._prev[slot] = self._tail
        self._next[slot] = _NIL
        if self._tail == _NIL:
            self._head = slot
        else:
            self._next[self._tail] = slot
        self._tail = slot
        self._in[slot] = 1
        self._len += 1

    def _unlink(self, slot: int) -> None:
        assert self._in[slot], f"slot {slot} is not in the LRU order"
        p, n = self._prev[slot], self._next[slot]
        if p == _NIL:
            self._head = n
        else:
            self._next[p] = n
        if n == _NIL:
            self._tail = p
        else:
            self._prev[n] = p
        self._in[slot] = 0
        self._len -= 1

    admit = _append
    unpin = _append
    pin = _unlink
    forget = _unlink

    def touch(self, slot: int) -> None:
        if slot != self._tail:
            self._unlink(slot)
            self._append(slot)
        else:
            assert self._in[slot], f"slot {slot} is not in the LRU order"

    def pin_run(self, slots: list[int]) -> None:
        """Unlink ``slots``: O(1) when they form a contiguous run of the order, forward or
        backward (a prefix stored or used together, the usual case), else one unlink
        per slot."""
        if len(slots) < _VECTOR_MIN:
            for s in slots:
                self._unlink(s)
            return
        run = np.array(slots, dtype=np.int32)
        nxt = np.frombuffer(self._next, dtype=np.int32)
        inside = np.frombuffer(self._in, dtype=np.int8)
        assert inside[run].all(), "pinning a slot not in the LRU order"
        if (nxt[run[:-1]] == run[1:]).all():
            first, last = slots[0], slots[-1]
        elif (nxt[run[1:]] == run[:-1]).all():  # the run in reverse (unpinned last first)
            first, last = slots[-1], slots[0]
        else:
            for s in slots:
                self._unlink(s)
            return
        p, n = self._prev[first], self._next[last]
        if p == _NIL:
            self._head = n
        else:
            self._next[p] = n
        if n == _NIL:
            self._tail = p
        else:
            self._prev[n] = p
        inside[run] = 0
        self._len -= len(slots)

    def unpin_run(self, slots: list[int]) -> None:
        """Append ``slots`` in this order in one numpy pass."""
        if len(slots) < _VECTOR_MIN:
            for s in slots:
                self._append(s)
            return
        run = np.array(slots, dtype=np.int32)
        inside = np.frombuffer(self._in, dtype=np.int8)
        assert not inside[run].any(), "unpinning a slot already in the LRU order"
        prv = np.frombuffer(self._prev, dtype=np.int32)
        nxt = np.frombuffer(self._next, dtype=np.int32)
        first, last = slots[0], slots[-1]
        prv[run[1:]] = run[:-1]
        nxt[run[:-1]] = run[1:]
        prv[first] = self._tail
        nxt[last] = _NIL
        if self._tail == _NIL:
            self._head = first
        else:
            nxt[self._tail] = first
        self._tail = last
        inside[run] = 1
        self._len += len(slots)

    def touch_run(self, slots: list[int], run: np.ndarray | None = None) -> None:
        """Move ``slots`` to the back in this order. O(1) when they already form a
        contiguous run in that order (the usual case: a prefix stored or looked up
        together), else one move per slot."""
        if not slots:
            return
        nxt = self._next
        first, last = slots[0], slots[-1]
        if len(slots) >= _VECTOR_MIN:  # one numpy pass instead of a Python loop
            if run is None:
                run = np.array(slots, dtype=np.int32)
            contiguous = bool((np.frombuffer(nxt, dtype=np.int32)[run[:-1]] == run[1:]).all())
        else:
            contiguous = all(nxt[a] == b for a, b in zip(slots, slots[1:], strict=False))
        if contiguous:
            assert self._in[first] and self._in[last], "touching a slot not in LRU order"
            if last == self._tail:
                return
            p, n = self._prev[first], nxt[last]
            if p == _NIL:
                self._head = n
            else:
                nxt[p] = n
            self._prev[n] = p  # n != _NIL since last is not the tail
            self._prev[first] = self._tail
            nxt[self._tail] = first
            nxt[last] = _NIL
            self._tail = last
            return
        for s in slots:
            self.touch(s)

    def pop_victim(self) -> int | None:
        if self._head == _NIL:
            return None
        slot = self._head
        self._unlink(slot)
        return slot

    def peek(self) -> int | None:
        return None if self._head == _NIL else self._head

    def first(self, k: int) -> list[int]:
        out: list[int] = []
        s = self._head
        while s != _NIL and len(out) < k:
            out.append(s)
            s = self._next[s]
        return out

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < len(self._in) and bool(self._in[slot])

    def __len__(self) -> int:
        return self._len

    def order(self) -> list[int]:
        """Slots from first to last victim (tests and debugging; O(n))."""
        out: list[int] = []
        s = self._head
        while s != _NIL:
            out.append(s)
            s = self._next[s]
        return out
