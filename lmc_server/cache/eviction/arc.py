"""ARC: adaptive replacement between recency and frequency (Megiddo and Modha, 2003).

Two lists of resident objects: ``T1`` (used once since admitted) and ``T2`` (used again),
each in LRU order, and two ghost lists of keys evicted from them, ``B1`` and ``B2``. A
target ``p`` for the size of ``T1`` adapts: admitting a key remembered in ``B1`` (T1 was
too small to keep it) raises ``p``; one remembered in ``B2`` lowers it. The victim comes
from ``T1`` while ``T1`` is larger than ``p``, else from ``T2``.

Differences from the paper, both forced by the partition's contract and both documented
in ``docs/benchmarks.md``:

- Pinned objects leave ``T1``/``T2`` (the policy holds only evictable slots); a released
  pin re-enters at the MRU end of ``T2``: a lease or a retrieve is a use.
- ``B1`` and ``B2`` are :class:`GhostTags` tables of about ``capacity`` cells each
  instead of exact LRU lists, so the ghost lists keep ~4 bytes per key and their
  lengths (the ``|B1|``/``|B2|`` in the adaptation step) are table occupancies.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmc_server.cache.eviction.base import NIL, EvictionPolicy, GhostTags, SlotLists
from lmc_server.cache.eviction.names import SUMMARIES

_T1, _T2 = 1, 2


class ARCPolicy(EvictionPolicy):
    name = "ARC"
    summary = SUMMARIES[name]

    def __init__(self, capacity: int = 0) -> None:
        self._lists = SlotLists(2)
        self._b1 = GhostTags()
        self._b2 = GhostTags()
        self._keys: Sequence[bytes | None] = ()
        self._cap = 0
        self._p = 0.0
        self.grow(capacity)

    def bind_keys(self, slot_key: Sequence[bytes | None]) -> None:
        self._keys = slot_key

    def grow(self, capacity: int) -> None:
        if capacity > self._cap:
            self._cap = capacity
            self._lists.grow(capacity)
            self._b1.grow(capacity)
            self._b2.grow(capacity)

    def _key(self, slot: int) -> bytes | None:
        return self._keys[slot] if slot < len(self._keys) else None

    def admit(self, slot: int) -> None:
        key = self._key(slot)
        b1, b2 = self._b1, self._b2
        if key is not None and b1.pop(key):
            self._p = min(float(self._cap), self._p + max(1.0, b2.size / max(1, b1.size)))
            self._lists.push(_T2, slot)
        elif key is not None and b2.pop(key):
            self._p = max(0.0, self._p - max(1.0, b1.size / max(1, b2.size)))
            self._lists.push(_T2, slot)
        else:
            self._lists.push(_T1, slot)

    def pin(self, slot: int) -> None:
        self._lists.unlink(slot)

    def unpin(self, slot: int) -> None:
        self._lists.push(_T2, slot)

    def touch(self, slot: int) -> None:
        assert self._lists.where[slot], f"slot {slot} is not in the ARC order"
        self._lists.move(_T2, slot)

    def forget(self, slot: int) -> None:
        lst = self._lists.unlink(slot)
        key = self._key(slot)
        if key is not None:
            (self._b1 if lst == _T1 else self._b2).add(key)

    def peek(self) -> int | None:
        lists = self._lists
        t1 = lists.head[_T1]
        if t1 != NIL and (lists.size[_T1] > self._p or lists.head[_T2] == NIL):
            return t1
        t2 = lists.head[_T2]
        return t2 if t2 != NIL else None

    def pop_victim(self) -> int | None:
        v = self.peek()
        if v is not None:
            self.forget(v)
        return v

    def first(self, k: int) -> list[int]:
        v = self.peek()
        if v is None:
            return []
        out = [v]
        s = self._lists.nxt[v]
        while s != NIL and len(out) < k:
            out.append(s)
            s = self._lists.nxt[s]
        return out

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < len(self._lists.where) and bool(self._lists.where[slot])

    def __len__(self) -> int:
        return self._lists.size[_T1] + self._lists.size[_T2]
