"""Batched pins (Partition.pin_many / unpin_many, the policies' pin_run / unpin_run)
leave every policy in exactly the state one pin or unpin at a time leaves it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lmc_server.cache.eviction.base import EvictionPolicy
from lmc_server.cache.eviction.registry import POLICIES
from lmc_server.cache.pool import PIN_VECTOR_MIN


def make(name: str, n: int) -> EvictionPolicy:
    cls: Any = POLICIES[name]
    p: EvictionPolicy = cls(n)
    for s in range(n):
        p.admit(s)
    return p


def drain(p: EvictionPolicy) -> list[int]:
    out = []
    while (v := p.pop_victim()) is not None:
        out.append(v)
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("shape", ["run", "reversed-run", "scattered", "short"])
def test_pin_and_unpin_runs_match_one_at_a_time(name: str, shape: str) -> None:
    n = 200
    rng = np.random.default_rng(7)
    k = PIN_VECTOR_MIN - 1 if shape == "short" else 64
    slots = {
        "run": list(range(30, 30 + k)),
        "reversed-run": list(range(30 + k - 1, 29, -1)),
        "scattered": rng.choice(n, k, replace=False).tolist(),
        "short": list(range(10, 10 + k)),
    }[shape]
    for round_ in range(3):  # pinned again after an unpin_run reversed the run's order
        a, b = make(name, n), make(name, n)
        for _ in range(round_):
            for s in slots:
                a.pin(s)
            for s in reversed(slots):
                a.unpin(s)
            b.pin_run(slots)
            b.unpin_run(slots[::-1])
        for s in slots:
            a.pin(s)
        b.pin_run(slots)
        assert len(a) == len(b) == n - k
        assert all(s not in b for s in slots)
        for s in reversed(slots):
            a.unpin(s)
        b.unpin_run(slots[::-1])
        assert drain(a) == drain(b)


def test_partition_pin_many_counts_each_pin_and_handles_a_slot_twice() -> None:
    """Through the index: a lease and a retrieve on the same prefix (pins stack), and a
    request naming one chunk twice; nothing becomes evictable while pinned."""
    from lmc_server.cache.index import L1Index
    from lmc_server.cache.layout import build_layout
    from lmc_server.testing.presets import dsv41_flash

    layout = build_layout(dsv41_flash().groups, 256, True)
    index = L1Index(4 * 64 * layout.chunk_bytes + (64 << 20), 64 << 20, "LRU")
    for s in range(index.pool_usage().slabs):
        index.slab_ready(s)
    view = index.view("t", layout)
    ids = {
        sec.group_index: np.zeros((64, sec.blocks_per_chunk), dtype=np.int64)
        for og in layout.object_groups
        for sec in og.sections
    }
    digests = b"".join(i.to_bytes(32, "little") for i in range(1, 65))
    keys = index.keys(view, digests)
    index.commit_store(index.reserve_store(view, keys, ids))
    hit, lease = index.lookup(view, keys, 1, 10.0, 0.0)
    assert hit == 64 and lease is not None
    ticket = index.pin_retrieve(view, keys, ids)
    index.release(lease.lease_id)
    twice = keys[:20] + keys[:20]  # the same 20 chunks twice in one request
    ids40 = {g: a[:40] for g, a in ids.items()}
    ticket2 = index.pin_retrieve(view, twice, ids40)
    index.check()
    # still pinned by the retrieves (the lease is gone): a pool's worth of new stores
    # must evict around them
    for k in range(4):
        more = index.keys(
            view, b"".join((1000 * (k + 1) + i).to_bytes(32, "little") for i in range(64))
        )
        index.commit_store(index.reserve_store(view, more, ids))
    assert index.lookup(view, keys, 1, 10.0, 0.0, take_lease=False)[0] == 64
    index.unpin_retrieve(ticket2, True)
    index.check()
    index.unpin_retrieve(ticket, True)
    index.check()
    for k in range(4):  # unpinned, the old prefix is evicted like any other
        more = index.keys(
            view, b"".join((9000 * (k + 1) + i).to_bytes(32, "little") for i in range(64))
        )
        index.commit_store(index.reserve_store(view, more, ids))
    assert index.lookup(view, keys, 1, 10.0, 0.0, take_lease=False)[0] < 64
