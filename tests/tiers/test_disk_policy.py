"""The disk write-policy model (lmc_server.bench.traces.tierpolicy) on traces small enough to
follow by hand."""

from __future__ import annotations

import pytest

from lmc_server.bench.traces.tierpolicy import simulate


def test_commit_writes_every_stored_chunk_and_keeps_l1_on_disk() -> None:
    reqs = [[1, 2], [3, 4], [1, 2]]  # L1 of 2: [1, 2] is evicted by [3, 4]
    r = simulate(reqs, l1_chunks=2, disk_chunks=10, policy="commit")
    assert (r.l1_hit_chunks, r.disk_hit_chunks, r.disk_writes) == (0, 2, 4)
    assert r.l1_kept_on_disk == 1.0


def test_evict_writes_only_what_l1_drops() -> None:
    reqs = [[1, 2], [3, 4], [1, 2]]
    r = simulate(reqs, l1_chunks=2, disk_chunks=10, policy="evict")
    # 1, 2 written when [3, 4] came in; 3, 4 when [1, 2] came back from disk.
    assert (r.l1_hit_chunks, r.disk_hit_chunks, r.disk_writes) == (0, 2, 4)
    assert r.l1_kept_on_disk == 1.0  # 1, 2 are in L1 and still on disk
    r = simulate([[1, 2], [1, 2]], l1_chunks=2, disk_chunks=10, policy="evict")
    assert r.disk_writes == 0 and r.l1_kept_on_disk == 0.0


def test_hit_writes_after_the_first_l1_hit_only() -> None:
    reqs = [[1, 2], [1, 2], [3, 4], [1, 2]]
    r = simulate(reqs, l1_chunks=2, disk_chunks=10, policy="hit")
    assert (r.l1_hit_chunks, r.disk_hit_chunks, r.disk_writes) == (2, 2, 2)


def test_the_disk_is_bounded_and_the_prefix_stops_at_its_first_miss() -> None:
    reqs = [[1, 2, 3], [4, 5, 6], [1, 2, 3]]
    r = simulate(reqs, l1_chunks=1, disk_chunks=4, policy="commit")
    # The disk keeps 3, 4, 5, 6 of the six written: 1 is gone, so nothing of
    # [1, 2, 3] hits (a prefix hit needs chunk 0), though 3 is there; the third
    # request stores 1, 2, 3 again, pushing out 3, 4 and (3 rewritten) 5.
    assert r.disk_hit_chunks == 0 and (r.disk_writes, r.disk_evictions) == (9, 5)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="one of commit, evict, hit"):
        simulate([[1]], 1, 1, "never")
