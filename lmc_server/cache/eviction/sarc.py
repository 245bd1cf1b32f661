"""SARC: ARC whose "seen before" test remembers far longer than the cache does.

Why not plain ARC. In a KV prefix cache most stored chunks are never used again (75% of
the distinct chunks of the conversation trace), and those that are come back after a
long time: half of all prefix hits on that trace come more than 384 requests (~18,000
stored chunks) after the chunk's previous use. ARC tells once-used from re-used objects
by hits while resident and by ghost lists one cache long, so in a cache smaller than the
reuse distance almost nothing is ever recognised as re-used, and ARC stays LRU.

What SARC does instead:

- A :class:`FrequencySketch` with ``SKETCH_FACTOR`` one-byte counters per slot counts
  every store and every hit of a key, halving all counts every table's worth of traffic.
  It recalls a key for tens of cache turnovers at 16-32 bytes per slot.
- Objects live in two LRU lists: ``COLD`` (stored, and the sketch has no record of the
  key: a first-time prefix) and ``WARM`` (hit while resident, or stored again after an
  eviction: a prefix that comes back). A hit moves an object to the MRU end of ``WARM``.
- The victim is the older of the two LRU ends, where a COLD object ages ``w`` times
  faster than a WARM one (age = uses of the policy's clock since its last use). ``w``
  adapts as ARC's target does: storing a key that COLD evicted lately (a small ghost
  table per list, :class:`GhostTags`) means COLD objects went too soon and lowers ``w``;
  one that WARM evicted raises it. ``1 <= w <= MAX_COLD_WEIGHT``; at ``w = 1`` the
  policy is exactly LRU, so the bound caps how far it can stray from LRU.

What it keeps from the prefix structure: the partition touches and stores a prefix's
chunks from the last to the first, so within a list a prefix is evicted from its tail
(which can only hit when its head does) and chunk 0 is the last to go; a shared system
prompt's chunks are hit by every request that extends them and stay at the MRU end of
``WARM``.

Pinned objects leave their list and re-enter the MRU end of ``WARM`` when their last pin
is released (a lease or a retrieve is a use). Per slot: 9 bytes of list links, 1 byte
of list id, 8 of last-use clock, 16-32 of sketch and 8-16 of ghost cells. Every
operation is O(1) (the sketch's halving is amortized).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from lmc_server.cache.eviction.base import (
    NIL,
    EvictionPolicy,
    FrequencySketch,
    GhostTags,
    SlotLists,
)
from lmc_server.cache.eviction.names import SUMMARIES

_COLD, _WARM = 1, 2
#: Sketch counters per slot of capacity (rounded down to a power of two in all, so
#: 16 to 32 bytes per slot): how far back "seen before" reaches.
SKETCH_FACTOR = 32
#: How much faster a COLD object ages than a WARM one, before any adaptation, and at
#: most: a bound of 2 keeps SARC within 0.01 of LRU on traffic where recency is all
#: that matters (multi-turn sessions: up to 0.016 below LRU with a bound of 256).
START_COLD_WEIGHT = 1.5
MAX_COLD_WEIGHT = 2.0
#: Relative change of the weight per ghost hit.
WEIGHT_STEP = 0.02


class SARCPolicy(EvictionPolicy):
    name = "SARC"
    summary = SUMMARIES[name]

    def __init__(self, capacity: int = 0) -> None:
        self._lists = SlotLists(2)
        self._sketch = FrequencySketch()
        self._ghost_cold = GhostTags()
        self._ghost_warm = GhostTags()
        self._keys: Sequence[bytes | None] = ()
        self._cap = 0
        self._used = array("q")
        self._clock = 0
        self._w = START_COLD_WEIGHT
        self.grow(capacity)

    def bind_keys(self, slot_key: Sequence[bytes | None]) -> None:
        self._keys = slot_key

    def grow(self, capacity: int) -> None:
        if capacity > self._cap:
            self._used.extend([0] * (capacity - self._cap))
            self._cap = capacity
            self._lists.grow(capacity)
            self._sketch.grow(capacity * SKETCH_FACTOR)
            self._ghost_cold.grow(capacity)
            self._ghost_warm.grow(capacity)

    def _key(self, slot: int) -> bytes | None:
        return self._keys[slot] if slot < len(self._keys) else None

    @property
    def cold_weight(self) -> float:
        """How many times faster COLD objects age than WARM ones (adaptive, >= 1)."""
        return self._w

    def _push(self, lst: int, slot: int) -> None:
        self._clock += 1
        self._used[slot] = self._clock
        self._lists.push(lst, slot)

    def admit(self, slot: int) -> None:
        key = self._key(slot)
        if key is None:
            self._push(_COLD, slot)
            return
        g_cold, g_warm = self._ghost_cold, self._ghost_warm
        if g_cold.pop(key):
            step = WEIGHT_STEP * max(1.0, g_warm.size / max(1, g_cold.size))
            self._w = max(1.0, self._w / (1.0 + step))
        elif g_warm.pop(key):
            step = WEIGHT_STEP * max(1.0, g_cold.size / max(1, g_warm.size))
            self._w = min(MAX_COLD_WEIGHT, self._w * (1.0 + step))
        seen = self._sketch.add(key)
        self._push(_WARM if seen else _COLD, slot)

    def pin(self, slot: int) -> None:
        self._lists.unlink(slot)

    def unpin(self, slot: int) -> None:
        self._push(_WARM, slot)

    def touch(self, slot: int) -> None:
        assert self._lists.where[slot], f"slot {slot} is not in the SARC order"
        key = self._key(slot)
        if key is not None:
            self._sketch.add(key)
        self._lists.unlink(slot)
        self._push(_WARM, slot)

    def forget(self, slot: int) -> None:
        lst = self._lists.unlink(slot)
        key = self._key(slot)
        if key is not None:
            (self._ghost_cold if lst == _COLD else self._ghost_warm).add(key)

    def peek(self) -> int | None:
        lists = self._lists
        cold, warm = lists.head[_COLD], lists.head[_WARM]
        if cold == NIL:
            return None if warm == NIL else warm
        if warm == NIL:
            return cold
        used = self._used
        return cold if (self._clock - used[cold]) * self._w >= self._clock - used[warm] else warm

    def pop_victim(self) -> int | None:
        v = self.peek()
        if v is not None:
            self.forget(v)
        return v

    def in_warm(self, slot: int) -> bool:
        """Whether an evictable ``slot`` is in WARM (tests)."""
        return self._lists.where[slot] == _WARM

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < len(self._lists.where) and bool(self._lists.where[slot])

    def __len__(self) -> int:
        return self._lists.size[_COLD] + self._lists.size[_WARM]
