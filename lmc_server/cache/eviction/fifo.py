"""FIFO: first in, first out by commit time (a baseline for the other policies)."""

from __future__ import annotations

import heapq
from array import array

import numpy as np

from lmc_server.cache.eviction.base import EvictionPolicy
from lmc_server.cache.eviction.names import SUMMARIES

#: A heap entry is ``seq << _SLOT_BITS | slot``.
_SLOT_BITS = 32


class FIFOPolicy(EvictionPolicy):
    """First in, first out by commit time; uses and pins do not change the order.

    A min-heap of ``seq << 32 | slot`` ints with lazy deletion: a pinned slot keeps its
    sequence number and re-enters at its old place when unpinned. An entry is live iff
    the slot is present and the entry's sequence is the slot's current one. The heap is
    rebuilt when dead entries outnumber live ones.
    """

    name = "FIFO"
    summary = SUMMARIES[name]

    def __init__(self, capacity: int = 0) -> None:
        self._seq = array("q")
        self._in = array("b")
        self._heap: list[int] = []
        self._next_seq = 0
        self._len = 0
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        extra = capacity - len(self._in)
        if extra > 0:
            self._seq.extend([0] * extra)
            self._in.extend([0] * extra)

    def _push(self, slot: int) -> None:
        assert not self._in[slot], f"slot {slot} is already in the FIFO order"
        self._in[slot] = 1
        self._len += 1
        heapq.heappush(self._heap, self._seq[slot] << _SLOT_BITS | slot)
        if len(self._heap) > 2 * self._len + 64:
            self._heap = [
                self._seq[s] << _SLOT_BITS | s for s in range(len(self._in)) if self._in[s]
            ]
            heapq.heapify(self._heap)

    def _drop(self, slot: int) -> None:
        assert self._in[slot], f"slot {slot} is not in the FIFO order"
        self._in[slot] = 0
        self._len -= 1

    def admit(self, slot: int) -> None:
        self._seq[slot] = self._next_seq
        self._next_seq += 1
        self._push(slot)

    unpin = _push
    pin = _drop
    forget = _drop

    def touch(self, slot: int) -> None:
        assert self._in[slot], f"slot {slot} is not in the FIFO order"

    def touch_run(self, slots: list[int], run: np.ndarray | None = None) -> None:
        pass

    def _live_head(self) -> int | None:
        heap = self._heap
        while heap:
            entry = heap[0]
            slot = entry & ((1 << _SLOT_BITS) - 1)
            if self._in[slot] and self._seq[slot] == entry >> _SLOT_BITS:
                return slot
            heapq.heappop(heap)
        return None

    def pop_victim(self) -> int | None:
        slot = self._live_head()
        if slot is not None:
            heapq.heappop(self._heap)
            self._drop(slot)
        return slot

    def peek(self) -> int | None:
        return self._live_head()

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < len(self._in) and bool(self._in[slot])

    def __len__(self) -> int:
        return self._len
