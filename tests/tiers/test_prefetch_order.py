"""An L2 prefetch commits a prefix as a store does: from its last chunk to its first.

In process (:func:`~lmc_server.testing.inprocess.run_server`), with the disk tier on a
``tmp_path`` directory as the tier below L1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmc_server.client import Client, chunk_digests
from lmc_server.protocol.stats import DiskReport
from lmc_server.testing.inprocess import run_server
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.presets import simple_model
from lmc_server.testing.tierworker import wait_for

CHUNK = 256


def disk_of(c: Client) -> DiskReport:
    disk = c.stats().disk
    assert disk is not None, "the server runs without a disk tier"
    return disk


def digests_of(seed: int, chunks: int) -> bytes:
    return chunk_digests(np.random.default_rng(seed).integers(0, 100_000, chunks * CHUNK), CHUNK)


def test_an_l2_prefetch_commits_a_prefix_from_its_last_chunk_to_its_first(tmp_path: Path) -> None:
    """docs/architecture.md: chunk 0, which every longer hit needs, is evicted last. A
    prefix brought back from the disk tier, then one object too many stored under FIFO
    (commit order is the eviction order): the prefix's last chunk goes, its first three
    still hit. (Committed first to last, chunk 0 went and the prefix hit nothing.)"""
    n = 4
    with (
        ShmKV(simple_model()) as kv,
        run_server(
            eviction_policy="FIFO",
            l1_size_gb=0.0625,
            slab_size_mb=16,
            disk_dir=str(tmp_path),
            disk_size_gb=0.25,
        ) as ts,
        Client(ts.endpoint) as c,
    ):
        kv.fill_random(5)
        reg = c.register(**kv.register_kwargs())
        wait_for(lambda: c.stats().l1.ready_slabs == c.stats().l1.slabs, "pool ready")
        prefix = digests_of(3, n)
        ids = block_ids_for(reg, n)
        assert c.store(reg, prefix, ids).ok.all()
        wait_for(
            lambda: disk_of(c).objects_written >= n and disk_of(c).writes_in_flight == 0,
            "the prefix on disk",
        )
        assert c.clear() == n
        wait_for(lambda: c.lookup(reg, prefix, lease=False).hit_chunks == n, "prefetched")
        st = c.stats()
        (part,) = st.partitions
        capacity = st.l1.slabs * (st.l1.slab_bytes // part.object_bytes)
        assert st.counters.evictions == 0
        fill, seed = capacity - n + 1, 100
        while fill:
            k = min(n, fill)
            assert c.store(reg, digests_of(seed, k), block_ids_for(reg, k)).ok.all()
            fill, seed = fill - k, seed + 1
        assert c.stats().counters.evictions == 1
        assert c.lookup(reg, prefix, lease=False).hit_chunks == n - 1
