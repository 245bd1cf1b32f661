"""Store bookkeeping: reserve WRITING slots and plan their copies, then commit or abort.

A store is :func:`reserve_store` (slots become WRITING, invisible to lookups, and a
copy plan comes back in a :class:`StoreTicket`), then, once the transfer engine reports
the copy complete, :func:`commit_store` or :func:`abort_store`. So a half-written
object is never visible. Which chunks are worth storing is the retentions' rule: every
section a hit requires (full attention) must have all its blocks, and at least one
section must have them (a window-only object stores the windows the engine still had);
each object records in its mask which sections it holds.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.allocator import SlotAllocator
from lmc_server.cache.counters import CacheStats
from lmc_server.cache.group_ids import no_holes
from lmc_server.cache.layout import RunCopy, plan_objects, section_block_ids
from lmc_server.cache.pool import COMMITTED
from lmc_server.cache.reservation import Reservation, finish
from lmc_server.cache.status import ChunkStatus
from lmc_server.cache.view import CacheView


@dataclass(slots=True, eq=False)
class StoreTicket:
    """A store in flight: reserved slots (WRITING) and the copies that fill them.

    ``statuses[og]`` holds one :class:`ChunkStatus` per chunk; reserved chunks say
    ``OK`` provisionally and become ``FAILED`` if the copy is aborted. ``others``
    counts the chunks reported ``IN_PROGRESS`` (another store is writing them): a store
    with none has nothing to wait for once its own copy is decided.
    """

    statuses: list[np.ndarray]
    reserved: list[Reservation]
    copies: list[RunCopy]
    nbytes: int
    others: int = 0
    done: bool = False


#: Status bytes as plain ints: numpy stores an ``IntEnum`` member about twice as slowly.
_OK, _EXISTS = int(ChunkStatus.OK), int(ChunkStatus.EXISTS)
_IN_PROGRESS, _NOT_AVAILABLE = int(ChunkStatus.IN_PROGRESS), int(ChunkStatus.NOT_AVAILABLE)
_NO_SPACE = int(ChunkStatus.NO_SPACE)
#: Below this many chunks statuses are set one by one (numpy's fixed cost dominates).
_SCALAR_MAX = 16


def reserve_store(
    view: CacheView,
    keys: list[bytes],
    group_ids: dict[int, np.ndarray],
    allocator: SlotAllocator,
    tick: int,
    stats: CacheStats,
) -> StoreTicket:
    """Reserve a WRITING slot for every storable (object group, chunk) at ``tick``.

    ``group_ids[g]`` is engine group ``g``'s ``(chunks, blocks_per_chunk)`` block ids,
    already bounds-checked, ``-1`` where the engine no longer has the block. A request
    with no -1 (the usual one) skips the per-section availability arrays: every chunk is
    storable with every section, which is what they would say.
    """
    n = len(keys)
    full = no_holes(group_ids)
    statuses: list[np.ndarray] = []
    reserved: list[Reservation] = []
    copies: list[RunCopy] = []
    nbytes = others = 0
    for og, part in zip(view.layout.object_groups, view._partitions, strict=True):
        st = np.empty(n, dtype=np.uint8)
        st.fill(_NOT_AVAILABLE)
        avail: list[np.ndarray] | None = None
        candidates: Iterable[int]
        if full:
            candidates = range(n)
        else:
            avail = [
                np.asarray((section_block_ids(sec, group_ids[sec.group_index]) >= 0).all(axis=1))
                for sec in og.sections
            ]
            storable = np.logical_or.reduce(avail)
            for bit in og.required_bits:
                storable &= avail[bit]
            candidates = np.flatnonzero(storable).tolist()
        fresh: list[int] = []
        fresh_keys: set[bytes] = set()
        #: slots of the chunks already committed, in chunk order: a store of them is a
        #: use, touched together below (chunk 0 ends the most recent)
        held = array("i")
        get = part.keys.get
        for i in candidates:
            key = keys[i]
            existing = get(key)
            if existing is not None:
                if part.state[existing] == COMMITTED:
                    st[i] = _EXISTS
                    held.append(existing)
                else:
                    st[i] = _IN_PROGRESS
                    others += 1
                continue
            if key in fresh_keys:  # the same digest twice in one request
                st[i] = _IN_PROGRESS
                others += 1
                continue
            fresh.append(i)
            fresh_keys.add(key)
        if held:
            part.touch_prefix(held, tick)
        # Slots in ascending order along the chunks: victims of one older request are
        # neighbours in the pool, so the request's objects land in a few contiguous
        # runs (one DMA each) instead of one run per object in descending order.
        slots = array("i", sorted(allocator.alloc(part, len(fresh), tick)))
        if len(slots) < len(fresh):
            st[fresh[len(slots) :]] = _NO_SPACE
            stats.bump(stats.alloc_failures, "no_space", len(fresh) - len(slots))
            del fresh[len(slots) :]
        if avail is None:
            masks = array("B", [(1 << len(og.sections)) - 1]) * len(fresh)
        else:
            bits = np.zeros(n, dtype=np.uint8)
            for bit, ok in enumerate(avail):
                bits |= ok.astype(np.uint8) << bit
            masks = array("B", bits[fresh].tobytes())
        chunks = array("i", fresh)
        for i, slot in zip(fresh, slots, strict=True):
            part.reserve(keys[i], slot, tick)
        if len(fresh) == n:
            st.fill(_OK)
        elif len(fresh) < _SCALAR_MAX:
            for i in fresh:
                st[i] = _OK
        else:
            st[fresh] = _OK
        statuses.append(st)
        if not chunks:
            continue
        reserved.append(Reservation(og.index, part, chunks, slots, masks, [keys[i] for i in fresh]))
        nbytes += plan_objects(
            og,
            part.offsets(slots),
            None if len(fresh) == n else np.frombuffer(chunks, dtype=np.int32),
            avail,
            group_ids,
            copies,
        )
    return StoreTicket(
        statuses=statuses, reserved=reserved, copies=copies, nbytes=nbytes, others=others
    )


def commit_store(ticket: StoreTicket, stats: CacheStats) -> None:
    """The copy completed: every reserved object becomes visible."""
    assert not ticket.done, "store ticket finished twice"
    ticket.done = True
    for r in ticket.reserved:
        finish(r)
        stats.stored_objects += len(r.slots)
        stats.stored_bytes += len(r.slots) * r.part.object_bytes


def abort_store(ticket: StoreTicket, stats: CacheStats) -> None:
    """The copy failed or its writer is gone: free every reserved slot."""
    assert not ticket.done, "store ticket finished twice"
    ticket.done = True
    for r in ticket.reserved:
        finish(r, [False] * len(r))
        ticket.statuses[r.og_index][np.frombuffer(r.chunks, dtype=np.int32)] = ChunkStatus.FAILED
        stats.bump(stats.alloc_failures, "aborted", len(r.slots))


def settle_in_progress(view: CacheView, keys: list[bytes], statuses: list[np.ndarray]) -> int:
    """A store's ``IN_PROGRESS`` chunks whose other writer finished, settled in place:
    ``EXISTS`` once committed, ``FAILED`` once gone (the copy failed or its writer went
    away). Returns how many are still being written."""
    waiting = 0
    for part, st in zip(view._partitions, statuses, strict=True):
        for i in np.flatnonzero(st == ChunkStatus.IN_PROGRESS).tolist():
            slot = part.keys.get(keys[i])
            if slot is None:
                st[i] = ChunkStatus.FAILED
            elif part.state[slot] == COMMITTED:
                st[i] = ChunkStatus.EXISTS
            else:
                waiting += 1
    return waiting
