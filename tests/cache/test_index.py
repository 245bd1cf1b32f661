"""The L1 index in process: hit rule, leases, eviction, slabs, invariants, memory."""

from __future__ import annotations

import ast
import gc
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import lmc_server
from lmc_server.cache.index import L1Index
from lmc_server.cache.layout import build_layout
from lmc_server.cache.status import ChunkStatus
from lmc_server.testing.digests import chained_digests as digests
from lmc_server.testing.l1 import dsv_view, ids_for, make_index, store
from lmc_server.testing.presets import dsv41_flash, simple_model

MIB = 1 << 20


def test_store_then_lookup_hits_everything() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(4))
    st = store(idx, v, keys)
    assert all((s == ChunkStatus.OK).all() for s in st)
    hit, lease = idx.lookup(v, keys, owner=1, lease_ttl_s=10, now_s=0)
    assert hit == 4 and lease is not None
    idx.check()


def test_gap_in_the_middle_reports_only_the_prefix() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(6))
    store(idx, v, keys[:2])
    store(idx, v, keys[3:])
    hit, _ = idx.lookup(v, keys, 1, 10, 0, take_lease=False)
    assert hit == 2


def test_window_object_only_needed_for_last_chunk() -> None:
    """Sliding-window blocks of older chunks are gone in the engine: still a full hit."""
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(5))
    swa = [g for g in range(2)]  # groups 0 and 1 are the sliding-window groups
    st = store(idx, v, keys, ids_for(v, 5, {g: [0, 1, 2, 3] for g in swa}))
    full, win = st
    assert (full == ChunkStatus.OK).all()
    assert list(win) == [ChunkStatus.NOT_AVAILABLE] * 4 + [ChunkStatus.OK]
    assert idx.lookup(v, keys, 1, 10, 0, take_lease=False)[0] == 5
    # a shorter prefix lacks its window: no hit at 3 chunks
    assert idx.lookup(v, keys[:3], 1, 10, 0, take_lease=False)[0] == 0


def test_combined_layout_tracks_window_sections_per_object() -> None:
    idx = make_index()
    v = dsv_view(idx, separate=False)
    keys = idx.keys(v, digests(3))
    store(idx, v, keys, ids_for(v, 3, {0: [0], 1: [0]}))
    assert idx.lookup(v, keys, 1, 10, 0, take_lease=False)[0] == 3
    assert idx.lookup(v, keys[:1], 1, 10, 0, take_lease=False)[0] == 0
    assert idx.lookup(v, keys[:2], 1, 10, 0, take_lease=False)[0] == 2


def test_missing_full_blocks_fail_only_that_chunk() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(3))
    full, _ = store(idx, v, keys, ids_for(v, 3, {2: [1]}))  # compressed group, chunk 1
    assert list(full) == [ChunkStatus.OK, ChunkStatus.NOT_AVAILABLE, ChunkStatus.OK]


def test_namespaces_and_salts_never_share_keys() -> None:
    idx = make_index()
    a = dsv_view(idx, ns="a")
    b = dsv_view(idx, ns="b")
    d = digests(2)
    store(idx, a, idx.keys(a, d))
    assert a._partitions == b._partitions  # same layout: shared slots
    assert idx.lookup(b, idx.keys(b, d), 1, 10, 0, False)[0] == 0
    assert idx.lookup(a, idx.keys(a, d, salt=b"s"), 1, 10, 0, False)[0] == 0
    assert idx.lookup(a, idx.keys(a, d), 1, 10, 0, False)[0] == 2


def test_sm90_and_sm100_use_different_partitions() -> None:
    idx = make_index()
    a = dsv_view(idx, arch="sm90")
    b = dsv_view(idx, arch="sm100")
    assert not set(map(id, a._partitions)) & set(map(id, b._partitions))


def test_store_is_idempotent_and_in_progress_is_reported() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(2))
    t1 = idx.reserve_store(v, keys, ids_for(v, 2))
    t2 = idx.reserve_store(v, keys, ids_for(v, 2))
    assert (t2.statuses[0] == ChunkStatus.IN_PROGRESS).all() and not t2.copies
    idx.commit_store(t1)
    idx.commit_store(t2)
    t3 = idx.reserve_store(v, keys, ids_for(v, 2))
    assert (t3.statuses[0] == ChunkStatus.EXISTS).all()
    idx.check()


def test_writing_objects_are_invisible_and_abort_frees_them() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(2))
    t = idx.reserve_store(v, keys, ids_for(v, 2))
    assert idx.lookup(v, keys, 1, 10, 0, False)[0] == 0
    used = sum(p.used_bytes for p in v._partitions)
    assert used > 0
    idx.abort_store(t)
    assert all((s == ChunkStatus.FAILED).all() for s in t.statuses)
    assert sum(p.used_bytes for p in v._partitions) == 0
    assert idx.lookup(v, keys, 1, 10, 0, False)[0] == 0
    idx.check()


def test_lru_evicts_least_recently_used_under_a_small_pool() -> None:
    idx = make_index(pool_mib=8, slab_mib=8)
    geo = simple_model(layers=4, bytes_per_token=1024)  # 1 MiB objects at 256 tokens
    v = idx.view("lru", build_layout(geo.groups, 256, True))
    part = v._partitions[0]
    assert part.object_bytes == MIB
    keys = [idx.keys(v, digests(1, tag=bytes([i])))[0] for i in range(10)]

    def put(k: bytes) -> list[np.ndarray]:
        return store(idx, v, [k], {0: np.arange(16, dtype=np.int64).reshape(1, 16)})

    for k in keys[:8]:
        put(k)
    idx.lookup(v, [keys[0]], 1, 10, 0, take_lease=False)  # touch 0: now most recent
    put(keys[8])  # evicts 1
    put(keys[9])  # evicts 2
    present = [i for i, k in enumerate(keys) if k in part.keys]
    assert present == [0, 3, 4, 5, 6, 7, 8, 9]
    assert idx.stats.evictions == 2
    idx.check()


def test_a_prefix_stored_again_still_loses_its_last_chunk_first() -> None:
    """A store of chunks the cache holds (the other ranks of a TP engine, a retried
    store) is a use: the prefix becomes the most recent, chunk 0 last of all, as a
    lookup leaves it. Were chunk 0 the first to go, every chunk after it would stay
    in L1 unreachable (a lookup stops at the first miss)."""
    idx = make_index(pool_mib=8, slab_mib=8)
    geo = simple_model(layers=4, bytes_per_token=1024)  # 1 MiB objects: 8 slots
    v = idx.view("again", build_layout(geo.groups, 256, True))
    ids = {0: np.arange(64, dtype=np.int64).reshape(4, 16) % 16}
    prefix = idx.keys(v, digests(4, tag=b"p"))
    store(idx, v, prefix, ids)
    st = store(idx, v, prefix, ids)  # every chunk EXISTS
    assert (st[0] == ChunkStatus.EXISTS).all()
    one = {0: np.arange(16, dtype=np.int64).reshape(1, 16)}
    for i in range(5):  # four fill the free slots, the fifth evicts one object
        store(idx, v, [idx.keys(v, digests(1, tag=b"f%d" % i))[0]], one)
    assert idx.stats.evictions == 1
    assert idx.lookup(v, prefix, 1, 10, 0, take_lease=False)[0] == 3  # the last chunk went
    idx.check()


def test_leased_chunk_survives_pressure_until_released() -> None:
    idx = make_index(pool_mib=8, slab_mib=8)
    geo = simple_model(layers=4, bytes_per_token=1024)
    v = idx.view("lease", build_layout(geo.groups, 256, True))
    ids = {0: np.arange(16, dtype=np.int64).reshape(1, 16)}
    keys = [idx.keys(v, digests(1, tag=bytes([i])))[0] for i in range(20)]
    store(idx, v, [keys[0]], ids)
    _, lease = idx.lookup(v, [keys[0]], owner=7, lease_ttl_s=5, now_s=100)
    assert lease is not None
    for k in keys[1:]:
        store(idx, v, [k], ids)
    assert keys[0] in v._partitions[0].keys  # survived 19 stores into 8 slots
    assert idx.expire_leases(now_s=104) == 0
    assert idx.expire_leases(now_s=105) == 1
    assert idx.stats.leases_expired == 1
    # unpinned = just used: it is now the most recent, evicted after the 7 others
    for i in range(7):
        store(idx, v, [idx.keys(v, digests(1, tag=b"x%d" % i))[0]], ids)
        assert keys[0] in v._partitions[0].keys
    store(idx, v, [idx.keys(v, digests(1, tag=b"y"))[0]], ids)
    assert keys[0] not in v._partitions[0].keys
    idx.check()


def test_pool_full_of_pins_fails_cleanly_per_chunk() -> None:
    idx = make_index(pool_mib=4, slab_mib=4)
    geo = simple_model(layers=4, bytes_per_token=1024)
    v = idx.view("full", build_layout(geo.groups, 256, True))
    keys = idx.keys(v, digests(6))
    ids = {0: np.tile(np.arange(16, dtype=np.int64), (4, 1))}
    st = store(idx, v, keys[:4], ids)
    assert (st[0] == ChunkStatus.OK).all()
    _, lease = idx.lookup(v, keys[:4], 1, 10, 0)
    assert lease is not None
    t = idx.reserve_store(v, keys[4:6], {0: ids[0][:2]})
    assert list(t.statuses[0]) == [ChunkStatus.NO_SPACE] * 2
    idx.commit_store(t)
    assert idx.stats.alloc_failures["no_space"] == 2
    assert idx.lookup(v, keys[:4], 1, 10, 0, take_lease=False)[0] == 4
    idx.release(lease.lease_id)
    assert all(p == 0 for p in v._partitions[0].pins)
    idx.check()


def test_cold_partition_gives_a_slab_to_a_new_one() -> None:
    idx = make_index(pool_mib=4, slab_mib=1)
    old = idx.view(
        "old", build_layout(simple_model(layers=1, bytes_per_token=1024).groups, 256, True)
    )
    new = idx.view(
        "new", build_layout(simple_model(layers=2, bytes_per_token=1024).groups, 256, True)
    )
    ids1 = {0: np.arange(16, dtype=np.int64).reshape(1, 16)}
    for i in range(16):  # 256 KiB objects: 4 per slab, fills all 4 slabs
        store(idx, old, idx.keys(old, digests(1, tag=bytes([i]))), ids1)
    assert idx.pool_usage().free_slabs == 0
    st = store(idx, new, idx.keys(new, digests(1, tag=b"n")), ids1)
    assert st[0][0] == ChunkStatus.OK
    assert idx.stats.slabs_moved == 1 and old._partitions[0].slabs == 3
    idx.check()


def test_clear_keeps_pinned_objects() -> None:
    idx = make_index()
    v = dsv_view(idx)
    keys = idx.keys(v, digests(3))
    store(idx, v, keys)
    _, lease = idx.lookup(v, keys[:1], 1, 10, 0)
    assert lease is not None
    idx.clear()
    assert idx.lookup(v, keys, 1, 10, 0, False)[0] == 1
    idx.release(lease.lease_id)
    idx.check()


@pytest.mark.parametrize("separate", [True, False])
def test_retrieve_pins_and_plans_only_what_it_reads(separate: bool) -> None:
    idx = make_index()
    v = dsv_view(idx, separate=separate)
    keys = idx.keys(v, digests(3))
    store(idx, v, keys)
    t = idx.pin_retrieve(v, keys, ids_for(v, 3))
    assert any(p.pins[s] for p, ss in t.pinned for s in ss)
    geo = dsv41_flash()
    window_bytes = 44 * 4 * 19008  # last chunk only
    full_bytes = 3 * (22 * 4 * 19008 + 22 * 4 * 4224)
    assert t.nbytes == window_bytes + full_bytes
    assert geo.chunk_bytes(256) * 3 > t.nbytes
    idx.unpin_retrieve(t, ok=True)
    assert all(p == 0 for part in v._partitions for p in part.pins)
    idx.check()


def test_metadata_is_at_most_256_bytes_per_object() -> None:
    """20,000 cached objects must cost megabytes of Python heap, not gigabytes."""
    n = 20_000
    geo = simple_model(layers=1, bytes_per_token=64, tokens_per_block=16)  # 16 KiB objects
    idx = L1Index(20 * 16 * MIB, 16 * MIB, "LRU")  # 20,480 slots of 16 KiB
    for s in range(idx.pool_usage().slabs):
        idx.slab_ready(s)
    v = idx.view("mem", build_layout(geo.groups, 256, True))
    ids = {0: np.tile(np.arange(16, dtype=np.int64), (1000, 1))}
    all_digests = digests(n)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(0, n, 1000):
        keys = idx.keys(v, all_digests[i * 32 : (i + 1000) * 32])
        idx.commit_store(idx.reserve_store(v, keys, ids))
        del keys
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_object = grown / n
    assert v._partitions[0].n_committed == n
    print(f"python heap per cached object: {per_object:.0f} bytes")
    assert per_object <= 256, per_object


def test_prefix_start_is_evicted_last() -> None:
    """Chunk 0 of a prefix is needed by every longer hit: LRU must keep it longest."""
    idx = make_index(pool_mib=4, slab_mib=4)
    geo = simple_model(layers=4, bytes_per_token=1024)  # 1 MiB objects: 4 slots
    v = idx.view("p", build_layout(geo.groups, 256, True))
    keys = idx.keys(v, digests(4))
    ids = {0: np.tile(np.arange(16, dtype=np.int64), (4, 1))}
    store(idx, v, keys, ids)
    store(idx, v, idx.keys(v, digests(1, tag=b"other")), {0: ids[0][:1]})
    assert idx.lookup(v, keys, 1, 10, 0, take_lease=False)[0] == 3
    idx.lookup(v, keys[:3], 1, 10, 0, take_lease=False)
    store(idx, v, idx.keys(v, digests(1, tag=b"more")), {0: ids[0][:1]})
    assert idx.lookup(v, keys, 1, 10, 0, take_lease=False)[0] == 3  # "other" went first


def test_slab_moves_never_evict_what_was_just_stored() -> None:
    """Two partitions filling one pool in turns: the newest batch of each stays whole."""
    idx = make_index(pool_mib=8, slab_mib=1)
    a = idx.view(
        "a", build_layout(simple_model(layers=1, bytes_per_token=1024).groups, 256, True)
    )  # 256 KiB objects
    b = idx.view(
        "b", build_layout(simple_model(layers=2, bytes_per_token=1024).groups, 256, True)
    )  # 512 KiB objects
    ids = {0: np.tile(np.arange(16, dtype=np.int64), (4, 1))}
    for round_ in range(30):
        batch = []
        for view, tag in ((a, b"a"), (b, b"b")):
            keys = idx.keys(view, digests(4, tag=tag + bytes([round_])))
            st = store(idx, view, keys, ids)
            assert (st[0] == ChunkStatus.OK).all(), (round_, tag)
            batch.append((view, keys))
        for view, keys in batch:  # a's batch survived b's store, whatever slabs moved
            assert idx.lookup(view, keys, 1, 10, 0, take_lease=False)[0] == 4, round_
        idx.check()
    assert a._partitions[0].slabs >= 2 and b._partitions[0].slabs >= 2


def test_an_idle_partition_gives_its_slabs_to_a_busy_one() -> None:
    idx = make_index(pool_mib=8, slab_mib=1)
    idle = idx.view(
        "idle", build_layout(simple_model(layers=1, bytes_per_token=1024).groups, 256, True)
    )
    busy = idx.view(
        "busy", build_layout(simple_model(layers=2, bytes_per_token=1024).groups, 256, True)
    )
    ids = {0: np.tile(np.arange(16, dtype=np.int64), (4, 1))}
    for i in range(4):  # 16 objects of 256 KiB: 4 slabs
        store(idx, idle, idx.keys(idle, digests(4, tag=b"i%d" % i)), ids)
    for i in range(40):  # busy keeps storing; idle never touches its objects again
        store(idx, busy, idx.keys(busy, digests(4, tag=b"b%d" % i)), ids)
    assert idx.stats.slabs_moved >= 3
    assert idle._partitions[0].slabs <= 1 and busy._partitions[0].slabs >= 7
    idx.check()


def test_a_request_in_a_full_pool_takes_ascending_contiguous_slots() -> None:
    """Eviction frees an older request's neighbouring slots (its chunks in reverse, as
    LRU orders them); the new request gets them in ascending order along its chunks,
    so its objects form a few contiguous pool ranges (one DMA each on CUDA)."""
    index = make_index(pool_mib=256, slab_mib=16)
    view = dsv_view(index)
    for r in range(12):  # well past the pool's capacity: every reservation evicts
        t = index.reserve_store(
            view, index.keys(view, digests(16, b"%d" % r), b""), ids_for(view, 16)
        )
        index.commit_store(t)
        for res in t.reserved:
            steps = np.diff(np.asarray(res.slots))
            assert (steps > 0).all(), f"request {r}: slots not ascending: {list(res.slots)}"
            assert (steps == 1).sum() >= len(steps) - 2, f"request {r}: {list(res.slots)}"
    assert index.stats.evictions > 0


def test_keys_refuse_ragged_digests_and_long_salts_and_accept_any_salt_up_to_the_limit() -> None:
    idx = make_index()
    v = dsv_view(idx)
    d = digests(2)
    with pytest.raises(ValueError, match="multiple of 32"):
        idx.keys(v, d[:-1])
    with pytest.raises(ValueError, match="multiple of 32"):
        idx.keys(v, d[:-1], salt=b"s")
    with pytest.raises(ValueError, match="salt longer than 256"):
        idx.keys(v, d, salt=bytes(257))
    long_a, long_b = idx.keys(v, d, salt=b"a" * 256), idx.keys(v, d, salt=b"a" * 255 + b"b")
    assert long_a != long_b and all(len(k) == 4 + 32 for k in long_a + long_b)
    assert idx.keys(v, d)[0][:4] == v.ns_prefix and idx.keys(v, d)[0][4:] == d[:32]


def test_digest_bytes_is_defined_once() -> None:
    """Every module reads DIGEST_BYTES from cache.keys; nobody assigns its own."""
    root = Path(lmc_server.__file__).parent
    owners = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "DIGEST_BYTES" for t in targets):
                    owners.append(path.relative_to(root).as_posix())
    assert owners == ["cache/keys.py"]


def test_a_store_awaits_a_slab_only_for_a_partition_without_one_while_slabs_are_pending() -> None:
    """``awaits_a_slab`` (the server's ``busy`` for a store that came too early) holds
    only where asking again soon finds room: an object group whose partition has no
    slab yet while the pool is still being prepared. A partition whose slabs are all
    pinned answers ``NO_SPACE`` as before, prepared pool or not."""
    slab = 16 << 20
    index = L1Index(4 * slab, slab, "LRU")
    index.slab_ready(0)
    view = dsv_view(index)  # separate object groups: two partitions
    ids = ids_for(view, 1)
    first = index.keys(view, digests(1, b"first"))
    t = index.reserve_store(view, first, ids)
    assert [int(st[0]) for st in t.statuses] == [ChunkStatus.OK, ChunkStatus.NO_SPACE]
    assert index.awaits_a_slab(view, t)  # the second group's partition has no slab
    index.abort_store(t)
    index.slab_ready(1)  # now each partition can have one
    t = index.reserve_store(view, first, ids)
    assert not index.awaits_a_slab(view, t)
    assert all(int(st[0]) == ChunkStatus.OK for st in t.statuses)
    index.commit_store(t)
    # fill both partitions' slabs with objects held by reads: nothing evictable left
    held = [index.pin_retrieve(view, first, ids)]
    for i in range(64):
        keys = index.keys(view, digests(1, b"fill%d" % i))
        t = index.reserve_store(view, keys, ids)
        no_space = any(int(st[0]) == ChunkStatus.NO_SPACE for st in t.statuses)
        if no_space:
            assert not index.awaits_a_slab(view, t), "a partition with slabs asked to wait"
            index.abort_store(t)
            break
        index.commit_store(t)
        held.append(index.pin_retrieve(view, keys, ids))
    else:
        raise AssertionError("the pinned slabs never filled")
    assert index.pool_usage().ready_slabs == 2  # two of four still being prepared
    for t_ in held:
        index.unpin_retrieve(t_, ok=True)
    index.check()
