"""A retrieve's plan from its cached shape equals the plan worked out chunk by chunk.

``cache/retrieve.py`` takes what a request needs of each object group from a shape
(layout, chunk count and prefix ends) when no block id is -1. This compares it, over
random indexes (some chunks stored, some with window sections only, some evicted) and
random requests (prefix ends, holes), with a reference written the plain way: which
sections of which chunks are needed, which are committed with them, and from where and
to which blocks each byte is copied. A shape that skipped a needed section would let a
retrieve report a chunk it never wrote.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmc_server.cache.index import L1Index
from lmc_server.cache.status import ChunkStatus
from lmc_server.cache.view import CacheView
from lmc_server.testing.digests import chained_digests as digests
from lmc_server.testing.l1 import dsv_view, ids_for, make_index, store


def reference(
    view: CacheView, keys: list[bytes], ids: dict[int, np.ndarray], ends: list[int]
) -> tuple[list[list[int]], set[tuple[int, int, int, tuple[int, ...]]]]:
    """Statuses per object group, and the (run offset, chunk, object offset, block ids)
    of every copy: what a retrieve of these chunks must read, by the retention rules."""
    n = len(keys)
    statuses: list[list[int]] = []
    copies: set[tuple[int, int, int, tuple[int, ...]]] = set()
    starts = [0, *ends[:-1]]
    for og, part in zip(view.layout.object_groups, view._partitions, strict=True):
        st = [int(ChunkStatus.SKIPPED)] * n
        for i in range(n):
            needed = []
            for bit, sec in enumerate(og.sections):
                own = ids[sec.group_index][i, sec.first_block : sec.first_block + sec.n_blocks]
                if not (own >= 0).any():
                    continue
                lo, hi = next((a, b) for a, b in zip(starts, ends, strict=True) if a <= i < b)
                if sec.is_window:
                    w = next(r for r in og.retentions if bit in r.bits)
                    if i < max(lo, hi - w.chunks):  # type: ignore[attr-defined]
                        continue
                needed.append(bit)
            if not needed:
                continue
            slot = part.keys.get(keys[i], -1)
            want = sum(1 << b for b in needed)
            if slot < 0 or part.state[slot] != 2 or (part.mask[slot] & want) != want:
                st[i] = int(ChunkStatus.MISS)
                continue
            st[i] = int(ChunkStatus.OK)
            off = int(part.offsets(np.array([slot], dtype=np.int32))[0])
            for bit in needed:
                sec = og.sections[bit]
                own = ids[sec.group_index][i, sec.first_block : sec.first_block + sec.n_blocks]
                for r in sec.runs:
                    copies.add((r.object_offset, i, off + r.object_offset, tuple(own.tolist())))
        statuses.append(st)
    return statuses, copies


def planned(
    idx: L1Index, view: CacheView, keys: list[bytes], ids: dict[int, np.ndarray], ends: list[int]
) -> tuple[list[list[int]], set[tuple[int, int, int, tuple[int, ...]]]]:
    t = idx.pin_retrieve(view, keys, ids, ends)
    copies: set[tuple[int, int, int, tuple[int, ...]]] = set()
    chunk_of: dict[int, int] = {}
    for part in view._partitions:
        for i, k in enumerate(keys):
            if k in part.keys:
                chunk_of[int(part.offsets(np.array([part.keys[k]], dtype=np.int32))[0])] = i
    for c in t.copies:
        for row, obj in zip(c.block_ids.tolist(), c.object_offsets.tolist(), strict=True):
            base = obj - c.run.object_offset
            copies.add((c.run.object_offset, chunk_of[base], obj, tuple(row)))
    statuses = [s.tolist() for s in t.statuses]
    idx.unpin_retrieve(t, True)
    return statuses, copies


@pytest.mark.parametrize("separate", [True, False])
def test_shaped_plans_match_the_reference(separate: bool) -> None:
    rng = np.random.default_rng(11)
    for case in range(60):
        idx = make_index(pool_mib=128)
        v = dsv_view(idx, separate=separate)
        n = int(rng.integers(1, 9))
        keys = idx.keys(v, digests(n, tag=bytes([case])))
        for i in range(n):  # some chunks stored, some of them without their windows
            if rng.random() < 0.8:
                holes = {0: [0], 1: [0]} if rng.random() < 0.3 else None
                store(idx, v, keys[i : i + 1], ids_for(v, 1, holes))
        cuts = sorted(set(rng.integers(1, n + 1, size=int(rng.integers(0, 3))).tolist()) | {n})
        for attempt in range(3):  # the same request again: shapes and plans are reused
            holes = (
                {int(g): [int(rng.integers(0, n))] for g in rng.integers(0, 4, size=2)}
                if attempt == 2
                else None
            )
            ids = ids_for(v, n, holes)
            assert planned(idx, v, keys, ids, cuts) == reference(v, keys, ids, cuts), (
                case,
                attempt,
                cuts,
            )
        idx.check()
