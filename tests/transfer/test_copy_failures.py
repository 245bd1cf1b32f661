"""A copy that fails or an engine that raises: a failed store fails its chunks and
commits nothing, nothing half-written becomes visible, a failed retrieve fails every
chunk and loses nothing, and the server goes on serving byte-exact.

The server runs in process (:func:`run_server`) with a CPU engine that fails chosen
submissions, so the real server path (zmq, index, engine threads, completions) is
exercised with real bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest

from lmc_server.cache.layout import RunCopy
from lmc_server.cache.status import ChunkStatus
from lmc_server.client import ChunkResult, Client, Registration, ServerError, chunk_digests
from lmc_server.testing import ShmKV, dsv41_flash
from lmc_server.testing.inprocess import ThreadServer, run_server
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.process import wait_pool_ready
from lmc_server.transfer.base import BufferMapping, DoneCallback
from lmc_server.transfer.cpu import CpuEngine

NUM_BLOCKS = 512
N = 8


class FailingEngine(CpuEngine):
    """The CPU engine recording each submission's chunk count; submissions whose 0-based
    number is in ``fail`` report an error instead of copying, those in ``boom`` raise
    (the number counts every submission of the server's life)."""

    def __init__(self, fail: Sequence[int] = (), boom: Sequence[int] = ()) -> None:
        super().__init__(copy_threads=2)
        self.fail = set(fail)
        self.boom = set(boom)  # submissions that raise, as a bug in an engine would
        self.submissions = 0
        self.parts: list[int] = []

    def submit(
        self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool, done: DoneCallback
    ) -> None:
        k = self.submissions
        self.submissions += 1
        self.parts.append(max(int(c.block_ids.shape[0]) for c in copies))
        if k in self.fail:
            done(f"injected failure of submission {k}")
            return
        if k in self.boom:
            raise RuntimeError(f"injected bug in submission {k}")
        super().submit(mapping, copies, to_pool, done)


@contextmanager
def _server(engine: CpuEngine) -> Iterator[ThreadServer]:
    with run_server(engine=engine, separate_object_groups=True) as ts:
        wait_pool_ready(ts.endpoint, 60)
        yield ts


def _store(c: Client, kv: ShmKV) -> tuple[Registration, bytes, dict[str, np.ndarray], ChunkResult]:
    """Register ``kv`` and store N chunks of it from random blocks."""
    reg = c.register(**kv.register_kwargs())
    digests = chunk_digests(np.arange(N * 256), 256)
    ids = block_ids_for(reg, N, np.random.default_rng(1))
    return reg, digests, ids, c.store(reg, digests, ids)


@pytest.fixture(scope="module")
def kv_pair() -> Iterator[tuple[ShmKV, ShmKV]]:
    """Two 702 MiB KV caches made and paged in once per module (1.7 s of CPU each time):
    the source is only read (stores copy out of it), the destination is zeroed again
    before every test (:func:`kv`)."""
    with (
        ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as src,
        ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as dst,
    ):
        src.fill_random(7)
        yield src, dst


@pytest.fixture
def kv(kv_pair: tuple[ShmKV, ShmKV]) -> tuple[ShmKV, ShmKV]:
    """The source as seeded, the destination all zero: a retrieve that copies nothing
    cannot pass a test because an earlier test wrote the same blocks."""
    src, dst = kv_pair
    dst.fill(0)
    return src, dst


def test_store_and_retrieve_are_one_submission_each_and_byte_exact(kv: tuple[ShmKV, ShmKV]) -> None:
    src, dst = kv
    engine = FailingEngine()
    with _server(engine) as ts, Client(ts.endpoint) as c:
        reg, digests, a, stored = _store(c, src)
        assert stored.ok.all() and engine.parts == [N]
        reg_b = c.register(**dst.register_kwargs())
        b = block_ids_for(reg_b, N, np.random.default_rng(2))
        assert c.lookup(reg_b, digests, lease=False).hit_chunks == N
        res = c.retrieve(reg_b, digests, b)
        assert res.ok.all() and engine.submissions == 2
        assert_same_pages(reg, src, a, dst, b, N)


def test_a_failed_store_fails_its_chunks_and_commits_nothing(kv: tuple[ShmKV, ShmKV]) -> None:
    src, dst = kv
    engine = FailingEngine(fail=[0])
    with _server(engine) as ts, Client(ts.endpoint) as c:
        reg, digests, a, res = _store(c, src)
        for name, st in res.statuses.items():
            assert st.tolist() == [ChunkStatus.FAILED] * N, name
        stats = c.stats()
        assert all(p.writing == 0 for p in stats.partitions)
        assert stats.l1.objects == 0
        assert c.lookup(reg, digests, lease=False).hit_chunks == 0
        # storing again stores everything, and it is served byte-exact
        assert c.store(reg, digests, a).ok.all()
        assert c.lookup(reg, digests, lease=False).hit_chunks == N
        reg_b = c.register(**dst.register_kwargs())
        b = block_ids_for(reg_b, N, np.random.default_rng(2))
        assert c.retrieve(reg_b, digests, b).ok.all()
        assert_same_pages(reg, src, a, dst, b, N)


def test_a_failed_retrieve_fails_every_chunk_and_loses_nothing(kv: tuple[ShmKV, ShmKV]) -> None:
    src, dst = kv
    engine = FailingEngine()
    with _server(engine) as ts, Client(ts.endpoint) as c:
        reg, digests, a, stored = _store(c, src)
        assert stored.ok.all()
        reg_b = c.register(**dst.register_kwargs())
        b = block_ids_for(reg_b, N, np.random.default_rng(2))
        engine.fail = {engine.submissions}
        res = c.retrieve(reg_b, digests, b)
        assert not res.ok.any()
        assert {int(x) for st in res.statuses.values() for x in st} <= {
            ChunkStatus.FAILED,
            ChunkStatus.SKIPPED,
        }
        st = c.stats()
        assert all(p.pinned_objects == 0 for p in st.partitions)
        assert st.l1.objects == 2 * N  # a failed read loses nothing
        res = c.retrieve(reg_b, digests, b)
        assert res.ok.all()
        assert_same_pages(reg, src, a, dst, b, N)


def test_an_engine_bug_in_a_store_leaves_nothing_half_written(kv: tuple[ShmKV, ShmKV]) -> None:
    """The engine raises on the store's submission: the store is answered with an
    internal error, its slots are freed, nothing becomes visible, and the server goes
    on serving."""
    src, _ = kv
    engine = FailingEngine(boom=[0])
    with _server(engine) as ts, Client(ts.endpoint) as c:
        with pytest.raises(ServerError, match="internal"):
            _store(c, src)
        st = c.stats()
        assert all(p.writing == 0 for p in st.partitions)
        assert st.l1.objects == 0
        reg, digests, _, again = _store(c, src)
        assert again.ok.all() and c.lookup(reg, digests, lease=False).hit_chunks == N


def test_an_engine_bug_in_a_retrieve_unpins_and_loses_nothing(kv: tuple[ShmKV, ShmKV]) -> None:
    src, dst = kv
    engine = FailingEngine()
    with _server(engine) as ts, Client(ts.endpoint) as c:
        reg, digests, a, stored = _store(c, src)
        assert stored.ok.all()
        reg_b = c.register(**dst.register_kwargs())
        b = block_ids_for(reg_b, N, np.random.default_rng(2))
        engine.boom = {engine.submissions}
        with pytest.raises(ServerError, match="internal"):
            c.retrieve(reg_b, digests, b)
        st = c.stats()
        assert all(p.pinned_objects == 0 for p in st.partitions)
        assert st.l1.objects == 2 * N
        assert c.retrieve(reg_b, digests, b).ok.all()
        assert_same_pages(reg, src, a, dst, b, N)
