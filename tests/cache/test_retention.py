"""Retention per section kind: the hit rule against an oracle over the cache's contents.

The oracle is the hit rule written out from its definition (docs/architecture.md, "The
hit rule"), read straight from the partitions: a ``k``-chunk prefix hits iff, in every
object group, every full section is committed for chunks ``0..k-1`` and every window
section of ``W`` tokens for the last ``ceil(W / chunk_size)`` chunks. Random stores
(engine blocks missing at random), aborts, evictions and leases then try to make the
index report a hit whose sections are not there, or one a retrieve would miss.
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec
import numpy as np
import pytest

from lmc_server.cache.geometry import GroupSpec, check_groups
from lmc_server.cache.index import L1Index
from lmc_server.cache.layout import build_layout
from lmc_server.cache.pool import COMMITTED
from lmc_server.cache.retention import (
    FullRetention,
    WindowRetention,
    object_retentions,
    retention_kind,
)
from lmc_server.cache.status import ChunkStatus
from lmc_server.cache.view import CacheView
from lmc_server.testing.digests import chained_digests as digests
from lmc_server.testing.presets import dsv41_flash

MIB = 1 << 20
CHUNK = 256


def groups_with_windows(windows: tuple[int, ...]) -> list[GroupSpec]:
    """DSV4.1-shaped groups, sliding-window group ``i`` with window ``windows[i]``."""
    geo = dsv41_flash(sliding_groups=len(windows), num_blocks=256)
    out = []
    for g in geo.groups:
        if g.kind == "sliding_window":
            g = msgspec.structs.replace(g, window_tokens=windows[int(g.name[3:])])
        out.append(g)
    check_groups(out, CHUNK, "sm90", geo.buffer_sizes)
    return out


def expected_hit(view: CacheView, keys: list[bytes]) -> int:
    """The hit rule from its definition, read from the partitions' slot tables."""
    groups = {}
    for og in view.layout.object_groups:
        for bit, sec in enumerate(og.sections):
            groups[(og.index, bit)] = sec.window_tokens

    def has(og_index: int, bit: int, i: int) -> bool:
        part = view._partitions[og_index]
        slot = part.keys.get(keys[i])
        return (
            slot is not None and part.state[slot] == COMMITTED and bool(part.mask[slot] >> bit & 1)
        )

    for k in range(len(keys), 0, -1):
        ok = True
        for (og_index, bit), window in groups.items():
            first = 0 if window == 0 else max(0, k - math.ceil(window / CHUNK))
            if not all(has(og_index, bit, i) for i in range(first, k)):
                ok = False
                break
        if ok:
            return k
    return 0


def random_ids(
    view: CacheView, n: int, rng: random.Random, p_missing: float
) -> dict[int, np.ndarray]:
    """Block ids per cached group; each (group, chunk) loses a block with ``p_missing``."""
    out = {}
    for og in view.layout.object_groups:
        for sec in og.sections:
            bpc = sec.blocks_per_chunk
            ids = np.arange(n * bpc, dtype=np.int64).reshape(n, bpc) % 256
            for c in range(n):
                if rng.random() < p_missing:
                    ids[c, rng.randrange(bpc)] = -1
            out[sec.group_index] = ids
    return out


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("windows", [(128, 128), (600,), (128, 600), (2048, 256)])
def test_lookup_matches_the_rule_and_a_retrieve_of_the_hit_never_misses(
    separate: bool, windows: tuple[int, ...]
) -> None:
    rng = random.Random(hash((separate, windows)) & 0xFFFF)
    groups = groups_with_windows(windows)
    layout = build_layout(groups, CHUNK, separate)
    slab_bytes = max(og.object_bytes for og in layout.object_groups)
    index = L1Index(24 * layout.chunk_bytes, slab_bytes, "LRU")
    for s in range(index.pool_usage().slabs):
        index.slab_ready(s)
    view = index.view("ns", layout)
    n = 10
    prompts = [index.keys(view, digests(n, b"p%d" % p)) for p in range(3)]
    leases: list[Any] = []
    hits = 0
    for step in range(60):
        keys = rng.choice(prompts)
        lo = rng.choice([0, rng.randrange(n)])
        hi = rng.randrange(lo + 1, n + 1)
        ticket = index.reserve_store(view, keys[lo:hi], random_ids(view, hi - lo, rng, 0.1))
        if rng.random() < 0.15:
            index.abort_store(ticket)
        else:
            index.commit_store(ticket)
        if leases and rng.random() < 0.3:
            index.release(leases.pop(rng.randrange(len(leases))))
        for keys in prompts:
            m = rng.randrange(1, n + 1)
            want = expected_hit(view, keys[:m])
            k, lease = index.lookup(view, keys[:m], 1, 10, 0, take_lease=rng.random() < 0.3)
            assert k == want, (step, m)
            hits += k > 0
            if lease is not None:
                leases.append(lease.lease_id)
            if k == 0:
                continue
            t = index.pin_retrieve(view, keys[:k], random_ids(view, k, rng, 0))
            assert not any((st == ChunkStatus.MISS).any() for st in t.statuses), (step, k)
            if lease is not None:  # a lease pins exactly what the retrieve reads
                assert {(id(p), s) for p, ss in lease.pins for s in ss} == {
                    (id(p), s) for p, ss in t.pinned for s in ss
                }
            index.unpin_retrieve(t, ok=True)
        index.check()
    assert hits > 10  # the scenario exercised hits, not only misses


def test_a_window_hit_needs_every_chunk_of_a_multi_chunk_window() -> None:
    """W = 600 tokens spans 3 chunks of 256: a hole in any of them is a miss there."""
    layout = build_layout(groups_with_windows((600,)), CHUNK, True)
    index = L1Index(64 * MIB * 16, 64 * MIB)
    for s in range(index.pool_usage().slabs):
        index.slab_ready(s)
    view = index.view("ns", layout)
    keys = index.keys(view, digests(6, b"w"))
    ids = random_ids(view, 6, random.Random(0), 0)
    ids[0][3] = -1  # the window group lost chunk 3 (full groups still have it)
    index.commit_store(index.reserve_store(view, keys, ids))
    got = [index.lookup(view, keys[:m], 1, 10, 0, take_lease=False)[0] for m in range(1, 7)]
    # prefixes 4, 5, 6 need chunk 3's window (their last 3 chunks): no hit at 4..6,
    # the longest hit within each is 3 (chunks 0..2 all have their windows).
    assert got == [1, 2, 3, 3, 3, 3]


def test_retentions_cover_every_section_once_required_first() -> None:
    for separate in (True, False):
        layout = build_layout(groups_with_windows((128, 600)), CHUNK, separate)
        for og in layout.object_groups:
            bits = sorted(b for r in og.retentions for b in r.bits)
            assert bits == list(range(len(og.sections))), og.name
            assert [r.required for r in og.retentions] == sorted(
                (r.required for r in og.retentions), reverse=True
            )
            for r in og.retentions:
                for b in r.bits:
                    sec = og.sections[b]
                    assert isinstance(r, WindowRetention) == sec.is_window
                    if isinstance(r, WindowRetention):
                        assert r.chunks == math.ceil(sec.window_tokens / CHUNK)
            assert og.required_bits == tuple(
                b for b, s in enumerate(og.sections) if not s.is_window
            )


def test_window_sections_with_the_same_chunk_count_share_one_retention() -> None:
    groups = groups_with_windows((128, 200))  # both round up to one chunk
    rs = object_retentions([g for g in groups if g.cached], CHUNK)
    assert [type(r) for r in rs] == [FullRetention, WindowRetention]
    assert rs[0].bits == (2, 3) and rs[1].bits == (0, 1) and rs[1].mask == 0b11


def test_each_kind_stores_its_blocks_and_needs_its_chunks() -> None:
    groups = groups_with_windows((128, 600))
    swa128, swa600, full = groups[0], groups[1], groups[2]
    assert retention_kind(full) is FullRetention
    assert retention_kind(swa128) is WindowRetention
    assert FullRetention.stored_blocks(full, 4) == 4
    assert WindowRetention.stored_blocks(swa128, 8) == 4  # 128 tokens of 32-token blocks
    assert WindowRetention.stored_blocks(swa600, 8) == 8  # window longer than the chunk
    full_r, w = FullRetention((0,)), WindowRetention((1,), chunks=3)
    assert [full_r.first_needed(k) for k in (1, 5)] == [0, 0]
    assert [w.first_needed(k) for k in (1, 3, 4, 10)] == [0, 0, 1, 7]
    need = np.zeros((2, 10), dtype=bool)
    full_r.mark_needed(need, [(0, 4), (4, 10)])
    w.mark_needed(need, [(0, 4), (4, 10)])
    assert need[0].all()
    assert np.flatnonzero(need[1]).tolist() == [1, 2, 3, 7, 8, 9]
