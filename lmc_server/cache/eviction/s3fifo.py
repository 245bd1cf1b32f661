"""S3-FIFO: a small probationary FIFO, a main FIFO and a ghost queue (Yang et al., SOSP 2023).

New objects enter the small queue ``S`` (about 10% of the objects); most objects in a
prefix cache are never used again and leave from there after a short stay. An object
used while in ``S`` moves on to the main queue ``M`` instead of being evicted; the key
of an object evicted from ``S`` unused is remembered in a ghost table, and if it is
stored again it goes straight to ``M``. ``M`` is a FIFO with up to 3 bits of frequency
per object: its head is re-queued (one frequency spent) instead of evicted while it has
frequency left, which approximates LRU without moving objects on every use.

Deviations forced by the partition's contract (documented in ``docs/benchmarks.md``):
a pinned object leaves its queue (the policy holds only evictable slots) and re-enters
at the tail of the same queue when its last pin is released, since a lease or a retrieve
is a use; the ghost queue is a :class:`GhostTags` table of about ``capacity`` cells.

Cost: ``touch`` is O(1) (a frequency increment); ``peek`` moves heads on until one is a
victim, and each move spends a frequency a touch paid for or moves an object from ``S``
to ``M`` once, so it is amortized O(1).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from lmc_server.cache.eviction.base import NIL, EvictionPolicy, GhostTags, SlotLists
from lmc_server.cache.eviction.names import SUMMARIES

_S, _M = 1, 2
_MAX_FREQ = 3
#: Share of the objects the small queue aims at (the paper's 10%).
SMALL_SHARE = 0.1


class S3FIFOPolicy(EvictionPolicy):
    name = "S3FIFO"
    summary = SUMMARIES[name]

    def __init__(self, capacity: int = 0) -> None:
        self._lists = SlotLists(2)
        self._freq = array("b")
        self._home = array("b")
        self._ghost = GhostTags()
        self._keys: Sequence[bytes | None] = ()
        self._cap = 0
        self.grow(capacity)

    def bind_keys(self, slot_key: Sequence[bytes | None]) -> None:
        self._keys = slot_key

    def grow(self, capacity: int) -> None:
        extra = capacity - self._cap
        if extra > 0:
            self._cap = capacity
            self._lists.grow(capacity)
            self._freq.extend(bytes(extra))
            self._home.extend(bytes(extra))
            self._ghost.grow(capacity)

    def _key(self, slot: int) -> bytes | None:
        return self._keys[slot] if slot < len(self._keys) else None

    def admit(self, slot: int) -> None:
        key = self._key(slot)
        lst = _M if key is not None and self._ghost.pop(key) else _S
        self._freq[slot] = 0
        self._home[slot] = lst
        self._lists.push(lst, slot)

    def pin(self, slot: int) -> None:
        self._lists.unlink(slot)

    def unpin(self, slot: int) -> None:
        self._lists.push(self._home[slot], slot)

    def touch(self, slot: int) -> None:
        assert self._lists.where[slot], f"slot {slot} is not in the S3-FIFO order"
        if self._freq[slot] < _MAX_FREQ:
            self._freq[slot] += 1

    def touch_run(self, slots: list[int], run: np.ndarray | None = None) -> None:
        for s in slots:
            self.touch(s)

    def forget(self, slot: int) -> None:
        if self._lists.unlink(slot) == _S:
            key = self._key(slot)
            if key is not None:
                self._ghost.add(key)

    def peek(self) -> int | None:
        lists, freq, home = self._lists, self._freq, self._home
        size = lists.size
        while True:
            if size[_S] and (size[_S] > SMALL_SHARE * (size[_S] + size[_M]) or not size[_M]):
                t = lists.head[_S]
                if not freq[t]:
                    return t
                freq[t] = 0
                lists.unlink(t)
                lists.push(_M, t)
                home[t] = _M
                continue
            t = lists.head[_M]
            if t == NIL:
                return None
            if not freq[t]:
                return t
            freq[t] -= 1
            lists.move(_M, t)

    def pop_victim(self) -> int | None:
        v = self.peek()
        if v is not None:
            self.forget(v)
        return v

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < len(self._lists.where) and bool(self._lists.where[slot])

    def __len__(self) -> int:
        return self._lists.size[_S] + self._lists.size[_M]
