"""A Hypothesis state machine against a live server and a simple model of the cache.

The model knows which keys are pinned by live leases (they must hit and retrieve) and
which may have been evicted. Whatever the interleaving of store, lookup, retrieve, release,
eviction pressure and client death, a retrieve returns exactly the bytes committed for that
key or a miss (a miss only for unpinned keys), never anything else; lease and pin counts on
the server match the model after every step and return to zero at the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.process import ServerProcess

KEYS = 24
SLOTS = 16  # 4 MiB pool of 1 MiB slabs holding four 256 KiB objects each
BPC = 16  # blocks per 256-token chunk at 16 tokens per block


@pytest.fixture(scope="module")
def live() -> Iterator[ServerProcess]:
    with ServerProcess(["--slab-size-mb", "1", "--lease-ttl-s", "600"], l1_size_gb=4 / 1024) as srv:
        yield srv


def digest(i: int) -> bytes:
    return chunk_digests(np.full(256, i, dtype=np.int64), 256)


def test_cache_behaves_like_its_model(live: ServerProcess) -> None:
    geo = simple_model(layers=1, bytes_per_token=1024, num_blocks=(KEYS + 2) * BPC)
    with Client(live.endpoint) as c, ShmKV(geo) as src, ShmKV(geo) as dst:
        src.fill_random(12)
        reg_src = c.register(**src.register_kwargs())
        reg_dst = c.register(**dst.register_kwargs())
        Machine.setup(live, c, src, dst, reg_src, reg_dst)
        run = Machine.TestCase
        run.settings = settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        run().runTest()


class Machine(RuleBasedStateMachine):
    srv: ServerProcess
    c: Client
    src: ShmKV
    dst: ShmKV
    reg_src: object
    reg_dst: object

    @classmethod
    def setup(
        cls, srv: ServerProcess, c: Client, src: ShmKV, dst: ShmKV, reg_src: object, reg_dst: object
    ) -> None:
        cls.srv, cls.c, cls.src, cls.dst = srv, c, src, dst
        cls.reg_src, cls.reg_dst = reg_src, reg_dst

    def __init__(self) -> None:
        super().__init__()
        self.c.clear()
        self.leases: dict[int, int] = {}  # lease id -> key
        self.filler = 0

    @staticmethod
    def src_ids(i: int) -> np.ndarray:
        return np.arange(i * BPC, (i + 1) * BPC, dtype=np.int32)

    def pinned(self) -> set[int]:
        return set(self.leases.values())

    @rule(i=st.integers(0, KEYS - 1))
    def store(self, i: int) -> None:
        res = self.c.store(self.reg_src, digest(i), {"full": self.src_ids(i)})  # type: ignore[arg-type]
        (status,) = [int(s[0]) for s in res.statuses.values()]
        assert status in (ChunkStatus.OK, ChunkStatus.EXISTS, ChunkStatus.NO_SPACE), status
        if status == ChunkStatus.NO_SPACE:
            assert len(self.pinned()) == SLOTS, "NO_SPACE with free or evictable slots"

    @rule(i=st.integers(0, KEYS - 1), lease=st.booleans())
    def lookup(self, i: int, lease: bool) -> None:
        r = self.c.lookup(self.reg_src, digest(i), lease=lease)  # type: ignore[arg-type]
        if i in self.pinned():
            assert r.hit_chunks == 1, "a leased chunk must hit"
        if r.lease_id:
            assert r.hit_chunks == 1
            self.leases[r.lease_id] = i

    @rule(i=st.integers(0, KEYS - 1), at=st.integers(0, 1))
    def retrieve(self, i: int, at: int) -> None:
        target = np.arange((KEYS + at) * BPC, (KEYS + at + 1) * BPC, dtype=np.int32)
        self.dst.fill(0)
        res = self.c.retrieve(self.reg_dst, digest(i), {"full": target})  # type: ignore[arg-type]
        (status,) = [int(s[0]) for s in res.statuses.values()]
        if status == ChunkStatus.OK:
            got = self.dst.pages("full", target.tolist())
            assert got == self.src.pages("full", self.src_ids(i).tolist()), f"key {i}: bytes"
        else:
            assert status == ChunkStatus.MISS, status
            assert i not in self.pinned(), f"key {i} is leased but missed"

    @precondition(lambda self: bool(self.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        assert self.c.release(lease_id)
        del self.leases[lease_id]

    @rule(n=st.integers(1, SLOTS + 4))
    def pressure(self, n: int) -> None:
        """Fill with chunks outside the model's keys: unpinned keys may be evicted."""
        for _ in range(n):
            self.filler += 1
            self.c.store(
                self.reg_src,  # type: ignore[arg-type]
                digest(10_000 + self.filler),
                {"full": self.src_ids(KEYS)},
            )

    @rule(i=st.integers(0, KEYS - 1))
    def client_dies_holding_a_lease(self, i: int) -> None:
        before = self.c.stats().leases
        ghost = Client(self.srv.endpoint)
        greg = ghost.register(**self.src.register_kwargs())
        took = ghost.lookup(greg, digest(i)).lease_id
        ghost.close()  # no unregister, no release: the connection just goes away
        t0 = time.monotonic()
        while self.c.stats().leases != before or self.c.stats().registrations != 2:
            assert time.monotonic() - t0 < 5, "dead client's lease and registration linger"
            time.sleep(0.02)
        assert not took or not self.c.release(took)

    @invariant()
    def server_matches_model(self) -> None:
        report = self.c.stats()
        assert report.leases == len(self.leases)
        pinned = sum(p.pinned_objects for p in report.partitions)
        assert pinned == len(self.pinned())
        assert all(p.writing == 0 for p in report.partitions)

    def teardown(self) -> None:
        for lease_id in list(self.leases):
            assert self.c.release(lease_id)
        report = self.c.stats()
        assert report.leases == 0
        assert all(p.pinned_objects == 0 for p in report.partitions)
