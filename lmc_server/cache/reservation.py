"""The one reservation type: WRITING slots of one partition, committed last to first.

Whoever fills L1 slots (a store's copy from the engine, an L2 prefetch's copy from a
lower tier) holds a :class:`Reservation` from the index: slots in the WRITING state,
invisible to lookups, bound to their keys. When the copies end, :func:`finish` commits
the objects whose copy completed and aborts the rest, always from the last chunk to the
first, so chunk 0 (which every longer hit needs) ends the most recent in the eviction
order and is evicted last. A reservation is also how the index names committed objects
to the L2 write-behind (:meth:`~lmc_server.cache.index.L1Index.pin_object`): the queue
holds reservations, never slots it could change by itself.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.allocator import SlotAllocator
from lmc_server.cache.pool import COMMITTED, Partition
from lmc_server.cache.view import CacheView


@dataclass(frozen=True, slots=True)
class Reservation:
    """Objects of one object group's partition: per object its chunk index in the
    request, slot, section mask and key, in ascending chunk order."""

    og_index: int
    part: Partition
    chunks: array
    slots: array
    masks: array
    keys: list[bytes]

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def fingerprint(self) -> bytes:
        """The layout fingerprint of the objects (the L2 tiers' key space)."""
        return self.part.fingerprint

    @property
    def object_bytes(self) -> int:
        return self.part.object_bytes

    def offsets(self) -> np.ndarray:
        """Pool byte offsets of the objects (int64, one per object)."""
        return self.part.offsets(np.frombuffer(self.slots, dtype=np.int32))

    def take(self, which: Sequence[int]) -> Reservation:
        """The objects at positions ``which`` (ascending), as a reservation."""
        return Reservation(
            self.og_index,
            self.part,
            array("i", (self.chunks[j] for j in which)),
            array("i", (self.slots[j] for j in which)),
            array("B", (self.masks[j] for j in which)),
            [self.keys[j] for j in which],
        )


def finish(r: Reservation, ok: Sequence[bool] | None = None) -> Reservation:
    """Commit the objects whose copy completed (``ok[j]``; every one when ``ok`` is
    None), abort the others, from the last chunk to the first. Returns the committed
    objects."""
    part, slots, masks = r.part, r.slots, r.masks
    if ok is None:
        for j in range(len(slots) - 1, -1, -1):  # chunk 0 ends most recent
            part.commit(slots[j], masks[j])
        return r
    kept: list[int] = []
    for j in range(len(slots) - 1, -1, -1):
        if ok[j]:
            part.commit(slots[j], masks[j])
            kept.append(j)
        else:
            part.abort(slots[j])
    kept.reverse()
    return r if len(kept) == len(slots) else r.take(kept)


def reserve_fill(
    view: CacheView,
    keys: list[bytes],
    wanted: Mapping[int, tuple[Iterable[int], Iterable[int]]],
    allocator: SlotAllocator,
    tick: int,
) -> tuple[list[Reservation], dict[int, list[int]]]:
    """WRITING slots for objects a caller copies in itself (an L2 prefetch).

    ``wanted[og_index]`` is (chunk indices into ``keys``, their section masks) in
    ascending chunk order. A chunk whose key L1 already holds (a store took it
    meanwhile) is skipped. Returns one reservation per object group that got slots and,
    per object group, the chunks left without a slot (the last ones: allocation is by
    the index's rule, free slots, then slabs, then eviction).
    """
    out: list[Reservation] = []
    no_space: dict[int, list[int]] = {}
    for og_index, (chunks, masks) in wanted.items():
        part = view._partitions[og_index]
        held = part.keys
        items = [(i, mask) for i, mask in zip(chunks, masks, strict=True) if keys[i] not in held]
        slots = allocator.alloc(part, len(items), tick)
        if len(slots) < len(items):
            no_space[og_index] = [i for i, _ in items[len(slots) :]]
        if not slots:
            continue
        items = items[: len(slots)]
        for (i, _), slot in zip(items, slots, strict=True):
            part.reserve(keys[i], slot, tick)
        out.append(
            Reservation(
                og_index,
                part,
                array("i", (i for i, _ in items)),
                array("i", slots),
                array("B", (m for _, m in items)),
                [keys[i] for i, _ in items],
            )
        )
    return out, no_space


def pin_object(r: Reservation, j: int) -> tuple[int, int] | None:
    """Pin object ``j`` of ``r`` for a read if its slot still holds its key, committed:
    its (pool offset, section mask); None when it was evicted (or replaced) since."""
    part, slot = r.part, r.slots[j]
    if part.slot_key[slot] != r.keys[j] or part.state[slot] != COMMITTED:
        return None
    part.pin(slot)
    offset = int(part.offsets(np.array([slot]))[0])
    return offset, part.mask[slot]


def unpin_object(r: Reservation, j: int) -> None:
    r.part.unpin(r.slots[j])
