"""Identical retrieves share one plan, and a shared plan never reads a slot that changed.

The tensor-parallel ranks of one engine load the same prefix into the same block ids at
once; the index plans such a retrieve once (:class:`~lmc_server.cache.retrieve.RetrievePlans`)
and the ranks in flight together share one pin of its objects. These tests try to make
a reused plan read the wrong object: after an eviction, after the key moved to another
slot, after a missing chunk was committed, with other block ids, with another geometry.
"""

from __future__ import annotations

import numpy as np

from lmc_server.cache.index import L1Index
from lmc_server.cache.layout import build_layout
from lmc_server.cache.status import ChunkStatus
from lmc_server.cache.view import CacheView
from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV
from lmc_server.testing.digests import chained_digests as digests
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.l1 import dsv_view, ids_for, make_index, store
from lmc_server.testing.presets import dsv41_flash
from lmc_server.testing.process import ServerProcess

NUM_BLOCKS = 96


def _offsets(t: object) -> list[tuple[int, list[int]]]:
    return [(id(c.run), c.object_offsets.tolist()) for c in t.copies]  # type: ignore[attr-defined]


def _served(t: object) -> bool:
    """Every chunk read or not needed (a window object group skips older chunks)."""
    st = np.concatenate(t.statuses)  # type: ignore[attr-defined]
    return bool(np.isin(st, (ChunkStatus.OK, ChunkStatus.SKIPPED)).all() and (st == 0).any())


def _pins(idx: L1Index, view: CacheView) -> list[int]:
    return [int(sum(p.pins)) for p in view._partitions]


def _held(t: object) -> bool:
    """Every object the retrieve reads is still indexed and pinned."""
    return all(
        part.pins[s] > 0 and s in set(part.keys.values())
        for part, slots in t.pinned  # type: ignore[attr-defined]
        for s in slots.slots
    )


def test_identical_retrieves_share_a_plan_and_its_pins() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(4))
    store(idx, v, keys)
    ids = ids_for(v, 4)
    a = idx.pin_retrieve(v, keys, ids)
    one = _pins(idx, v)
    assert all(one)
    b = idx.pin_retrieve(v, keys, {g: x.copy() for g, x in ids.items()})
    assert idx.retrieve_plans.planned == 1 and idx.retrieve_plans.reused == 1
    assert a.copies is b.copies and _offsets(a) == _offsets(b)
    assert _served(a)
    assert a.statuses[0] is not b.statuses[0]  # each request's own statuses
    assert _pins(idx, v) == one  # one pin for both
    idx.unpin_retrieve(b, False)  # a failed copy fails only its own request
    assert not any((s == ChunkStatus.OK).any() for s in b.statuses)
    assert (np.concatenate(b.statuses) == ChunkStatus.FAILED).any() and _served(a)
    assert _pins(idx, v) == one  # a still holds them
    idx.clear()  # evicts what no retrieve reads, nothing a holder reads
    assert _held(a) and _pins(idx, v) == one
    idx.unpin_retrieve(a, True)
    assert _pins(idx, v) == [0, 0]
    idx.check()


def test_shared_pins_hold_until_the_last_holder_whatever_the_order() -> None:
    """Holders of one plan and of its successor (made after a commit changed the
    partitions) release in any order: the objects stay pinned, and safe from eviction,
    until every retrieve that reads them is done."""
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(4))
    store(idx, v, keys)
    ids = ids_for(v, 4)
    first = [idx.pin_retrieve(v, keys, ids) for _ in range(3)]
    store(idx, v, idx.keys(v, digests(2, tag=b"other")))  # a commit: a new plan next
    second = [idx.pin_retrieve(v, keys, ids) for _ in range(2)]
    assert idx.retrieve_plans.planned == 2 and idx.retrieve_plans.reused == 3
    assert second[0].plan is not first[0].plan
    assert _offsets(second[0]) == _offsets(first[0])  # the same objects, pinned twice
    for t in (first[1], second[0], first[0], second[1]):
        idx.unpin_retrieve(t, True)
        idx.clear()
        assert _held(first[2])
    assert all(_pins(idx, v))  # first[2] still holds the objects
    again = idx.pin_retrieve(v, keys, ids)
    assert _served(again) and _offsets(again) == _offsets(first[2])
    idx.unpin_retrieve(again, True)
    idx.unpin_retrieve(first[2], True)
    assert _pins(idx, v) == [0, 0]
    idx.check()


def test_a_plan_is_not_reused_after_its_objects_moved() -> None:
    idx = make_index(pool_mib=64, slab_mib=16)
    v = dsv_view(idx)
    keys = idx.keys(v, digests(2))
    store(idx, v, keys)
    ids = ids_for(v, 2)
    first = idx.pin_retrieve(v, keys, ids)
    old = _offsets(first)
    idx.unpin_retrieve(first, True)
    assert idx.clear() > 0  # evicted: the slots are free again
    gone = idx.pin_retrieve(v, keys, ids)
    assert not gone.copies and not any((s == ChunkStatus.OK).any() for s in gone.statuses)
    idx.unpin_retrieve(gone, True)
    # other keys take the old slots first, so the same keys land elsewhere
    store(idx, v, idx.keys(v, digests(2, tag=b"other")))
    store(idx, v, keys)
    again = idx.pin_retrieve(v, keys, ids)
    assert _served(again)
    assert _offsets(again) != old
    for part, slots in again.pinned:
        held = {part.keys[k] for k in keys if k in part.keys}
        assert set(slots) <= held  # only slots the keys hold now
    idx.unpin_retrieve(again, True)
    assert idx.retrieve_plans.planned == 3 and idx.retrieve_plans.reused == 0
    idx.check()


def test_a_chunk_committed_since_is_read() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(3))
    store(idx, v, keys[:2])
    ids = ids_for(v, 3)
    t = idx.pin_retrieve(v, keys, ids)
    assert ChunkStatus.MISS in [int(s[2]) for s in t.statuses]
    idx.unpin_retrieve(t, True)
    store(idx, v, keys[2:])
    t = idx.pin_retrieve(v, keys, ids)
    assert _served(t) and all(int(s[2]) == ChunkStatus.OK for s in t.statuses)
    idx.unpin_retrieve(t, True)
    assert idx.retrieve_plans.reused == 0


def test_other_block_ids_or_prefix_ends_get_their_own_plan() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(4))
    store(idx, v, keys)
    ids = ids_for(v, 4)
    shifted = {g: (x + 1) % 64 for g, x in ids.items()}
    holes = ids_for(v, 4, missing={0: [1]})
    tickets = [
        idx.pin_retrieve(v, keys, ids),
        idx.pin_retrieve(v, keys, shifted),
        idx.pin_retrieve(v, keys, holes),
        idx.pin_retrieve(v, keys, ids, prefix_ends=[2, 4]),
    ]
    assert idx.retrieve_plans.planned == 4 and idx.retrieve_plans.reused == 0
    base = {id(c.run): c.block_ids for c in tickets[0].copies}
    for c in tickets[1].copies:
        assert np.array_equal(c.block_ids, (base[id(c.run)] + 1) % 64)
    for t in tickets:
        idx.unpin_retrieve(t, True)
    idx.check()


def test_ranks_of_one_geometry_share_plans_other_geometries_do_not() -> None:
    idx = make_index(pool_mib=128)
    block = dsv41_flash(placement="block")
    layer = dsv41_flash(placement="layer")
    ranks = [idx.view("ns", build_layout(block.groups, 256, True)) for _ in range(2)]
    other = idx.view("ns", build_layout(layer.groups, 256, True))
    assert ranks[0].layout is ranks[1].layout and other.layout is not ranks[0].layout
    keys = idx.keys(ranks[0], digests(2))
    store(idx, ranks[0], keys)
    ids = ids_for(ranks[0], 2)
    t0 = idx.pin_retrieve(ranks[0], keys, ids)
    t1 = idx.pin_retrieve(ranks[1], keys, ids)
    t2 = idx.pin_retrieve(other, keys, ids)
    assert t0.copies is t1.copies and t2.copies is not t0.copies
    assert {c.run for c in t2.copies}.isdisjoint({c.run for c in t0.copies})
    for t in (t0, t1, t2):
        idx.unpin_retrieve(t, True)
    idx.check()


def test_plans_are_bounded() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(1))
    store(idx, v, keys)
    for first in range(idx.retrieve_plans.size + 5):
        ids = {g: (x + first) % 64 for g, x in ids_for(v, 1).items()}
        idx.unpin_retrieve(idx.pin_retrieve(v, keys, ids), True)
    assert len(idx.retrieve_plans._plans) == idx.retrieve_plans.size


def test_ranks_never_read_a_stale_shared_plan_bytes(server: ServerProcess) -> None:
    """Two TP ranks (replicated KV) load one prefix with identical retrieves, byte for
    byte; the prefix is evicted, other chunks take its slots, the same digests are
    stored again with new bytes, and identical retrieves must read the new bytes."""
    n = 3
    geo = dsv41_flash(num_blocks=NUM_BLOCKS)
    with (
        Client(server.endpoint) as c0,
        Client(server.endpoint) as c1,
        ShmKV(geo) as kv0,
        ShmKV(geo) as kv1,
        ShmKV(geo) as src,
    ):
        regs = [
            c.register(**kv.register_kwargs(world_size=2, rank=r, replicated=True))
            for r, (c, kv) in enumerate(((c0, kv0), (c1, kv1)))
        ]
        digests = chunk_digests(np.arange(n * 256) + 7_000_000, 256)
        others = chunk_digests(np.arange(n * 256) + 9_000_000, 256)
        src_ids = block_ids_for(regs[0], n)
        dst_ids = block_ids_for(regs[0], n, first_block=n * 8)
        other_ids = block_ids_for(regs[0], n, first_block=2 * n * 8)
        for seed in (1, 2):
            src.fill_random(seed)
            for s, d in zip(src.segments, kv0.segments, strict=True):
                d.array[:] = s.array
            if seed == 2:
                c0.clear()
                assert c0.store(regs[0], others, other_ids).ok.all()  # into the old slots
            assert c0.store(regs[0], digests, src_ids).ok.all()
            for kv in (kv0, kv1):
                for s in kv.segments:
                    s.array[:] = 0
            before = c0.stats().counters
            for c, reg in ((c0, regs[0]), (c1, regs[1])):
                assert c.retrieve(reg, digests, dst_ids).ok.all()
            after = c0.stats().counters
            assert after.retrieved_objects > before.retrieved_objects
            # the store since made the last plan stale: rank 0 plans, rank 1 reuses it
            # (the stats counter operators see, lmcache_retrieve_plans_total)
            plans = {
                k: after.retrieve_plans.get(k, 0) - before.retrieve_plans.get(k, 0)
                for k in ("planned", "reused")
            }
            assert plans == {"planned": 1, "reused": 1}
            for kv, reg in ((kv0, regs[0]), (kv1, regs[1])):
                assert_same_pages(reg, src, src_ids, kv, dst_ids, n)
