"""Retrieve bookkeeping: pin the objects a retrieve reads and plan their copies.

A retrieve is :func:`pin_retrieve` (objects pinned, a copy plan back in a
:class:`RetrieveTicket`) then :func:`unpin_retrieve` once the copy finished. An object
being read is pinned, so it is never evicted, and its slot never reused, under the copy.
Which sections of which chunks are read is the retentions' rule
(:meth:`~lmc_server.cache.retention.Retention.mark_needed`): full sections for every
chunk, window sections only for the chunks in their window at the end of each prefix.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.counters import CacheStats
from lmc_server.cache.layout import RunCopy, plan_objects, section_block_ids
from lmc_server.cache.pool import COMMITTED, Partition
from lmc_server.cache.status import ChunkStatus
from lmc_server.cache.view import CacheView


@dataclass(slots=True, eq=False)
class RetrieveTicket:
    """A retrieve in flight: the objects it pinned and the copies that read them."""

    statuses: list[np.ndarray]
    pinned: list[tuple[Partition, array]]
    copies: list[RunCopy]
    nbytes: int
    objects: int
    done: bool = False


def pin_retrieve(
    view: CacheView,
    keys: list[bytes],
    group_ids: dict[int, np.ndarray],
    prefix_ends: list[int] | None,
    tick: int,
) -> RetrieveTicket:
    """Pin what a retrieve of these chunks (prefixes ending at ``prefix_ends``, exclusive
    chunk ends of the prefixes batched in one request; default one prefix) reads.

    A chunk whose needed sections are not all committed reports ``MISS`` and is not
    read; blocks with id ``-1`` are left untouched (and their sections not needed).
    """
    n = len(keys)
    ends = prefix_ends or [n]
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    statuses: list[np.ndarray] = []
    pinned: list[tuple[Partition, array]] = []
    copies: list[RunCopy] = []
    nbytes = objects = 0
    for og, part in zip(view.layout.object_groups, view.partitions, strict=True):
        st = np.full(n, ChunkStatus.SKIPPED, dtype=np.uint8)
        need = np.zeros((len(og.sections), n), dtype=bool)
        for r in og.retentions:
            r.mark_needed(need, bounds)
        for bit, sec in enumerate(og.sections):
            need[bit] &= (section_block_ids(sec, group_ids[sec.group_index]) >= 0).any(1)
        cand = np.flatnonzero(need.any(axis=0))
        get = part.keys.get
        found = np.array([get(keys[i], -1) for i in cand.tolist()], dtype=np.int64)
        want = (
            need[:, cand].astype(np.uint8) << np.arange(len(og.sections), dtype=np.uint8)[:, None]
        ).sum(axis=0, dtype=np.uint8)
        hit = found >= 0
        if hit.any():  # (a partition may have no slots at all yet)
            at = np.maximum(found, 0)
            hit &= (np.frombuffer(part.state, dtype=np.int8)[at] == COMMITTED) & (
                (np.frombuffer(part.mask, dtype=np.uint8)[at] & want) == want
            )
        missed = cand[~hit]
        st[missed] = ChunkStatus.MISS
        need[:, missed] = False
        chunks = array("i", cand[hit].tolist())
        slots = array("i", found[hit].tolist())
        part.pin_many(slots)  # pinned objects leave the eviction order: no touch needed
        np.frombuffer(part.tick, dtype=np.int64)[found[hit]] = tick
        st[cand[hit]] = ChunkStatus.OK
        statuses.append(st)
        if not chunks:
            continue
        pinned.append((part, slots))
        objects += len(slots)
        offsets = part.offsets(np.frombuffer(slots, dtype=np.int32))
        nbytes += plan_objects(
            og, offsets, np.frombuffer(chunks, dtype=np.int32), list(need), group_ids, copies
        )
    return RetrieveTicket(
        statuses=statuses, pinned=pinned, copies=copies, nbytes=nbytes, objects=objects
    )


def unpin_retrieve(ticket: RetrieveTicket, ok: bool, stats: CacheStats) -> None:
    """The copy finished (or failed: every pinned chunk then reports FAILED)."""
    assert not ticket.done, "retrieve ticket finished twice"
    ticket.done = True
    for part, slots in ticket.pinned:
        part.unpin_many(slots)
    if ok:
        stats.retrieved_objects += ticket.objects
        stats.retrieved_bytes += ticket.nbytes
    else:
        for st in ticket.statuses:
            st[st == ChunkStatus.OK] = ChunkStatus.FAILED
