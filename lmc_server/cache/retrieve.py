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
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.counters import CacheStats, CounterSet
from lmc_server.cache.group_ids import no_holes
from lmc_server.cache.layout import (
    ObjectGroupLayout,
    RegistrationLayout,
    RunCopy,
    plan_objects,
    section_block_ids,
)
from lmc_server.cache.pool import COMMITTED, Partition, SlotSet
from lmc_server.cache.status import ChunkStatus
from lmc_server.cache.view import CacheView


@dataclass(slots=True, eq=False)
class RetrieveTicket:
    """A retrieve in flight: the objects it pinned and the copies that read them.

    ``plan``: the plan whose pins it shares (see :class:`_Plan`), or None when it
    pinned ``pinned`` itself."""

    statuses: list[np.ndarray]
    pinned: list[tuple[Partition, SlotSet]]
    copies: list[RunCopy]
    nbytes: int
    objects: int
    done: bool = False
    plan: _Plan | None = None


@dataclass(slots=True, eq=False)
class _Plan:
    """What a retrieve reads, computed once: valid while every partition of its view
    stands at ``versions`` (no commit, eviction or abort since), because then every
    chunk still has the slot, state and sections it had. Its arrays are read-only: the
    same plan serves every identical retrieve (the tensor-parallel ranks of one
    engine load the same prefix into the same block ids at once).

    Identical retrieves in flight together share one pin of the plan's objects:
    ``holders`` counts the tickets that hold it; the first pins every object once, the
    last unpins them, the others only count. A pinned object is never evicted, freed
    or recommitted, so while ``holders > 0`` the objects are the ones the plan names
    (whether or not the plan is still current for new retrieves), and every object's
    pin count and place in the eviction order are what they would be had the first
    and the last of those retrieves been the only ones."""

    layout: RegistrationLayout
    versions: tuple[int, ...]
    statuses: list[np.ndarray]
    pinned: list[tuple[Partition, SlotSet]]
    ticked: list[np.ndarray]
    copies: list[RunCopy]
    nbytes: int
    objects: int
    holders: int = 0


class RetrievePlans:
    """The plans of the last few distinct retrieves, reused by identical ones.

    A retrieve is identical when it names the same layout (registrations of one
    geometry share one, :meth:`~lmc_server.cache.index.L1Index.layout`), the same keys,
    the same block ids and the same prefix ends. A plan is used only while its
    partitions' versions are unchanged (see :class:`_Plan`), so a reused plan never
    names a slot that was freed, reused or recommitted since it was made; the pins and
    the recency update are still made for every retrieve. Bounded: ``size`` plans, the
    least recently used dropped first.
    """

    def __init__(self, size: int = 16, counts: dict[str, int] | None = None) -> None:
        self.size = size
        self._plans: OrderedDict[tuple[object, ...], _Plan] = OrderedDict()
        #: what a request of each shape needs (:class:`_Shape`), for the plans made anew
        self.shapes: dict[tuple[object, ...], _Shape] = {}
        #: retrieves planned anew / served from a plan, by outcome (the index passes its
        #: ``CacheStats.retrieve_plans`` counter)
        self.counts: dict[str, int] = counts if counts is not None else {}

    @property
    def reused(self) -> int:
        return self.counts.get("reused", 0)

    @property
    def planned(self) -> int:
        return self.counts.get("planned", 0)

    @staticmethod
    def key(
        view: CacheView, keys: list[bytes], group_ids: dict[int, np.ndarray], ends: list[int]
    ) -> tuple[object, ...]:
        return (
            id(view.layout),
            tuple(keys),
            tuple(ends),
            tuple(group_ids),
            b"".join([a.tobytes() for a in group_ids.values()]),
            tuple(a.shape for a in group_ids.values()),
        )

    def get(self, key: tuple[object, ...], view: CacheView) -> _Plan | None:
        plan = self._plans.get(key)
        if plan is None:
            return None
        if plan.layout is not view.layout or plan.versions != _versions(view):
            del self._plans[key]
            return None
        self._plans.move_to_end(key)
        CounterSet.bump(self.counts, "reused")
        return plan

    def put(self, key: tuple[object, ...], plan: _Plan) -> None:
        CounterSet.bump(self.counts, "planned")
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)


def _versions(view: CacheView) -> tuple[int, ...]:
    return tuple([p.version for p in view._partitions])


def pin_retrieve(
    view: CacheView,
    keys: list[bytes],
    group_ids: dict[int, np.ndarray],
    prefix_ends: list[int] | None,
    tick: int,
    plans: RetrievePlans | None = None,
    plan_key: tuple[object, ...] | None = None,
) -> RetrieveTicket:
    """Pin what a retrieve of these chunks (prefixes ending at ``prefix_ends``, exclusive
    chunk ends of the prefixes batched in one request; default one prefix) reads.

    A chunk whose needed sections are not all committed reports ``MISS`` and is not
    read; blocks with id ``-1`` are left untouched (and their sections not needed).
    With ``plans``, an identical retrieve reuses the plan of an earlier one
    (:class:`RetrievePlans`). ``plan_key``: the caller's key for the request, in place
    of :meth:`RetrievePlans.key`; it must determine the layout, the keys, the block ids
    and the prefix ends as that does (the server's is the request's resolution key,
    :mod:`lmc_server.server.resolved`), and never equal a key of that form.
    """
    ends = prefix_ends or [len(keys)]
    key = (
        (plan_key if plan_key is not None else plans.key(view, keys, group_ids, ends))
        if plans is not None
        else None
    )
    plan = plans.get(key, view) if plans is not None and key is not None else None
    if plan is None:
        plan = _plan(view, keys, group_ids, ends, plans.shapes if plans is not None else None)
        if plans is not None and key is not None:
            plans.put(key, plan)
    if not plan.holders:  # the first holder pins (see _Plan)
        for part, slots in plan.pinned:
            part.pin_many(slots)  # pinned objects leave the eviction order: no touch needed
    plan.holders += 1
    for (part, _), idx in zip(plan.pinned, plan.ticked, strict=True):
        np.frombuffer(part.tick, dtype=np.int64)[idx] = tick
    return RetrieveTicket(
        statuses=[st.copy() for st in plan.statuses],
        pinned=plan.pinned,
        copies=plan.copies,
        nbytes=plan.nbytes,
        objects=plan.objects,
        plan=plan,
    )


@dataclass(frozen=True, slots=True, eq=False)
class _Shape:
    """What a retrieve of ``n`` chunks with prefix ends ``ends`` reads of one object group
    when none of its block ids is -1: which sections of which chunks (``need``), the
    chunks with any (``cand``), the sections each of those needs as a mask (``want``),
    and its statuses when every candidate hits (``all_hit``). It depends only on the
    layout, ``n`` and ``ends``: made once, read-only, shared."""

    layout: RegistrationLayout  # held, so that the id in its key is not reused
    need: np.ndarray
    cand: np.ndarray
    cand_list: list[int]
    want: np.ndarray
    want_list: list[int]
    all_hit: np.ndarray
    #: every section of every chunk is needed (no window leaves one out)
    need_all: bool


def _needed(
    og: ObjectGroupLayout,
    n: int,
    bounds: list[tuple[int, int]],
    group_ids: dict[int, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``need``, ``cand`` and ``want`` of one object group (``group_ids`` None: no -1)."""
    need = np.zeros((len(og.sections), n), dtype=bool)
    for r in og.retentions:
        r.mark_needed(need, bounds)
    if group_ids is not None:
        for bit, sec in enumerate(og.sections):
            need[bit] &= (section_block_ids(sec, group_ids[sec.group_index]) >= 0).any(1)
    cand = np.flatnonzero(need.any(axis=0))
    want = (
        need[:, cand].astype(np.uint8) << np.arange(len(og.sections), dtype=np.uint8)[:, None]
    ).sum(axis=0, dtype=np.uint8)
    return need, cand, want


def _shape(
    shapes: dict[tuple[object, ...], _Shape] | None,
    layout: RegistrationLayout,
    og: ObjectGroupLayout,
    n: int,
    ends: list[int],
    bounds: list[tuple[int, int]],
) -> _Shape:
    key = (id(layout), og.index, n, tuple(ends))
    shape = shapes.get(key) if shapes is not None else None
    if shape is None or shape.layout is not layout:
        need, cand, want = _needed(og, n, bounds, None)
        all_hit = np.full(n, ChunkStatus.SKIPPED, dtype=np.uint8)
        all_hit[cand] = ChunkStatus.OK
        for a in (need, cand, want, all_hit):
            a.flags.writeable = False
        need_all = bool(need.all())
        shape = _Shape(layout, need, cand, cand.tolist(), want, want.tolist(), all_hit, need_all)
        if shapes is not None:
            if len(shapes) >= SHAPES_MAX:
                shapes.pop(next(iter(shapes)))
            shapes[key] = shape
    return shape


#: Shapes kept per index (distinct layouts x object groups x request lengths x ends).
SHAPES_MAX = 1024


def _plan(
    view: CacheView,
    keys: list[bytes],
    group_ids: dict[int, np.ndarray],
    ends: list[int],
    shapes: dict[tuple[object, ...], _Shape] | None = None,
) -> _Plan:
    """The objects a retrieve reads and their copies, from the index as it is now.

    A request none of whose block ids is -1 (the usual case) takes what it needs of
    each object group from its :class:`_Shape`; with holes, it is worked out here."""
    n = len(keys)
    bounds = list(zip([0, *ends[:-1]], ends, strict=True))
    holes = not no_holes(group_ids)
    # the copies may read these arrays through views, and a plan outlives the request:
    # a caller's writable array is copied (the server's are read-only already)
    if any(a.flags.writeable for a in group_ids.values()):
        group_ids = {g: _frozen(a.copy()) if a.flags.writeable else a for g, a in group_ids.items()}
    statuses: list[np.ndarray] = []
    pinned: list[tuple[Partition, SlotSet]] = []
    ticked: list[np.ndarray] = []
    copies: list[RunCopy] = []
    nbytes = objects = 0
    for og, part in zip(view.layout.object_groups, view._partitions, strict=True):
        shape: _Shape | None = None
        if holes:
            need, cand, want = _needed(og, n, bounds, group_ids)
            cand_list = cand.tolist()
        else:
            shape = _shape(shapes, view.layout, og, n, ends, bounds)
            need, cand, want, cand_list = shape.need, shape.cand, shape.want, shape.cand_list
        get = part.keys.get
        found_list = [get(keys[i], -1) for i in cand_list]
        if shape is not None and len(cand_list) < _SCALAR_MAX:
            # a few chunks: each checked in Python (numpy's fixed cost dominates)
            state, mask = part.state, part.mask
            hit_list = [
                s >= 0 and state[s] == COMMITTED and mask[s] & w == w
                for s, w in zip(found_list, shape.want_list, strict=True)
            ]
            all_hit = all(hit_list)
            found = np.array(found_list, dtype=np.int64)
            hit = np.array(hit_list, dtype=bool)
        else:
            found = np.array(found_list, dtype=np.int64)
            hit = found >= 0
            if hit.any():  # (a partition may have no slots at all yet)
                at = np.maximum(found, 0)
                hit &= (np.frombuffer(part.state, dtype=np.int8)[at] == COMMITTED) & (
                    (np.frombuffer(part.mask, dtype=np.uint8)[at] & want) == want
                )
            all_hit = bool(hit.all())
        sections: list[np.ndarray] | None
        if shape is not None and all_hit:
            st = shape.all_hit
            chunks_arr = cand
            slot_list, hit_slots = found_list, found
            sections = None if shape.need_all else list(need)
        else:
            st = np.full(n, ChunkStatus.SKIPPED, dtype=np.uint8)
            need = need.copy()
            missed = cand[~hit]
            st[missed] = ChunkStatus.MISS
            need[:, missed] = False
            chunks_arr = cand[hit]
            st[chunks_arr] = ChunkStatus.OK
            st.flags.writeable = False
            hit_slots = found[hit]
            slot_list = hit_slots.tolist()
            sections = list(need)
        statuses.append(st)
        if not chunks_arr.size:
            continue
        chunks = array("i", chunks_arr.tolist())
        slots = array("i", slot_list)
        slot_set = SlotSet(slots)
        pinned.append((part, slot_set))
        ticked.append(_frozen(hit_slots))  # int64: the tick array's own index type
        objects += len(slots)
        nbytes += plan_objects(
            og,
            part.offsets(slots),
            None if len(chunks) == n else np.frombuffer(chunks, dtype=np.int32),
            sections,
            group_ids,
            copies,
        )
    for c in copies:
        c.block_ids.flags.writeable = False
        c.object_offsets.flags.writeable = False
    return _Plan(view.layout, _versions(view), statuses, pinned, ticked, copies, nbytes, objects)


#: Below this many candidate chunks a plan checks hits in Python (numpy's fixed cost
#: dominates).
_SCALAR_MAX = 16


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def unpin_retrieve(ticket: RetrieveTicket, ok: bool, stats: CacheStats) -> None:
    """The copy finished (or failed: every pinned chunk then reports FAILED)."""
    assert not ticket.done, "retrieve ticket finished twice"
    ticket.done = True
    plan = ticket.plan
    if plan is not None:
        assert plan.holders > 0, "a plan's pins released more often than taken"
        plan.holders -= 1
    if plan is None or not plan.holders:  # the last holder unpins (see _Plan)
        for part, slots in ticket.pinned:
            part.unpin_many(slots)
    if ok:
        stats.retrieved_objects += ticket.objects
        stats.retrieved_bytes += ticket.nbytes
    else:
        for st in ticket.statuses:
            st[st == ChunkStatus.OK] = ChunkStatus.FAILED
