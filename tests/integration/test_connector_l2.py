"""The connector's side of the L2 tier: a lookup whose hit stops short while the server
brings the continuation in from L2 answers "ask again" (lease released) until the
continuation is in L1 or a small bound passed, then loads byte-exact what its lease
covers.

Unit tests drive :class:`SchedulerPlanner` with hand-answered lookups; the runtime test
runs two real server processes sharing one real redis-server (started on a free
loopback port; without it the test skips, except under CI=true, where it fails).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from lmc_server.client import Client
from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.integration.planning import SchedulerPlanner
from lmc_server.integration.plans import LookupAnswer, LookupBatch
from lmc_server.integration.settings import ConnectorSettings
from lmc_server.protocol.stats import L2Report
from lmc_server.testing.connector_flow import ConnectorFlow, block_hashes
from lmc_server.testing.kvfixture import KVFixture, ShmBacking, describe_byte
from lmc_server.testing.lookup_fakes import batch_of
from lmc_server.testing.poll import wait_for
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.redis_process import RedisProcess, redis_server_path

CHUNK = 256
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class FakeLookups:
    """Lookups answered by hand: the test decides when and what each answers."""

    def __init__(self) -> None:
        self.pending: list[Future[LookupAnswer]] = []
        self.released: list[int] = []

    def lookup(self, digests: bytes) -> Future[LookupAnswer]:
        fut: Future[LookupAnswer] = Future()
        self.pending.append(fut)
        return fut

    def lookup_batch(self, prefixes: Sequence[bytes]) -> list[Future[LookupAnswer]]:
        return [self.lookup(d) for d in prefixes]

    def lookup_hashed(self, chunks: Sequence[int], digests: Callable[[int], bytes]) -> LookupBatch:
        """Hashed here, on the caller's thread (the link does it on its own)."""
        return batch_of(self.lookup_batch([digests(i) for i in range(len(chunks))]))

    def release(self, lease_id: int) -> None:
        self.released.append(lease_id)

    def answer(self, hit: int, lease: int, pending: int) -> None:
        fut = self.pending[-1]
        assert not fut.done()
        fut.set_result(LookupAnswer(hit, lease, 30.0, l2_pending_chunks=pending))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def planner(svc: FakeLookups, clock: Clock, **kw: Any) -> SchedulerPlanner:
    return SchedulerPlanner(
        ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc, clock=clock, **kw
    )


# a prompt of 4 whole chunks and a tail: at most 4 chunks (1024 tokens) can hit
TOKENS = list(range(4 * CHUNK + 10))
H = block_hashes(TOKENS, 16)


def ask(p: SchedulerPlanner, computed: int = 0) -> int | None:
    return p.matched_tokens("r", H, len(TOKENS), len(TOKENS), computed)


def test_pending_l2_answers_not_yet_and_releases_the_lease() -> None:
    svc, clock = FakeLookups(), Clock()
    p = planner(svc, clock)
    assert ask(p) is None
    svc.answer(1, 11, 3)  # one chunk in L1, three coming from L2
    assert ask(p) is None  # set aside: ask again
    assert svc.released == [11] and p.l2.waits == 1
    assert ask(p) is None and len(svc.pending) == 2  # the next step looks up again
    svc.answer(4, 12, 0)
    assert ask(p) == 4 * CHUNK
    assert ask(p) == 4 * CHUNK  # idempotent while the answer stands
    assert svc.released == [11]  # the lease of the hit that loads is held
    p.after_alloc("r", [list(range(1, 66))], 4 * CHUNK)
    (load,) = p.build_step([]).loads
    assert load.lease_id == 12 and load.n_chunks == 4


def test_bound_reached_uses_the_l1_hit_with_its_own_lease() -> None:
    svc, clock = FakeLookups(), Clock()
    p = planner(svc, clock, l2_wait_s=0.05)
    ask(p)
    svc.answer(1, 21, 3)
    assert ask(p) is None  # waiting starts at this answer
    clock.t += 0.03
    ask(p)
    svc.answer(2, 22, 2)  # part landed, more still coming, within the bound
    assert ask(p) is None and svc.released == [21, 22]
    clock.t += 0.03  # 0.06 s since the first pending answer
    ask(p)
    svc.answer(2, 23, 2)
    assert ask(p) == 2 * CHUNK  # the L1 hit of the last answer
    assert svc.released == [21, 22] and p.l2.expired == 1
    p.after_alloc("r", [list(range(1, 66))], 2 * CHUNK)
    (load,) = p.build_step([]).loads
    # the load reads exactly the chunks the lease it carries covers
    assert load.lease_id == 23 and load.n_chunks == 2


def test_nothing_pending_is_as_before() -> None:
    svc, clock = FakeLookups(), Clock()
    p = planner(svc, clock)
    ask(p)
    svc.answer(2, 31, 0)  # short hit, L2 off or has nothing
    assert ask(p) == 2 * CHUNK
    assert svc.released == [] and p.l2.waits == 0 and len(svc.pending) == 1


def test_full_hit_or_no_gain_does_not_wait() -> None:
    svc, clock = FakeLookups(), Clock()
    p = planner(svc, clock)
    ask(p)
    svc.answer(4, 41, 2)  # a full hit: nothing more to gain
    assert ask(p) == 4 * CHUNK and p.l2.waits == 0
    # the engine's own prefix cache already holds what L2 would bring
    svc2 = FakeLookups()
    p2 = planner(svc2, clock)
    assert ask(p2, computed=3 * CHUNK) is None
    svc2.answer(1, 42, 2)
    assert ask(p2, computed=3 * CHUNK) == 0
    assert p2.l2.waits == 0 and svc2.released == [42]


def test_zero_wait_never_waits() -> None:
    svc, clock = FakeLookups(), Clock()
    p = planner(svc, clock, l2_wait_s=0.0)
    ask(p)
    svc.answer(1, 51, 3)
    assert ask(p) == CHUNK and svc.released == [] and p.l2.waits == 0


def test_request_ending_while_waiting_releases_every_lease() -> None:
    svc, clock = FakeLookups(), Clock()
    p = planner(svc, clock)
    ask(p)
    svc.answer(1, 61, 3)
    assert ask(p) is None
    assert ask(p) is None  # second lookup in flight
    assert p.request_finished("r") is False
    svc.answer(4, 62, 0)  # answered after the request ended
    p.build_step([])
    assert svc.released == [61, 62] and p.tracked == 0


@pytest.mark.parametrize("value", ["-0.01", "nan", "inf", "6", "soon"])
def test_bad_l2_wait_refused(value: str) -> None:
    with pytest.raises(ValueError, match="l2_wait_s"):
        ConnectorSettings.from_extra({"lmcache.mp.l2_wait_s": value})


def test_l2_wait_setting() -> None:
    assert ConnectorSettings.from_extra({}).l2_wait_s == 0.05
    assert ConnectorSettings.from_extra({"lmcache.mp.l2_wait_s": "0"}).l2_wait_s == 0.0
    with pytest.raises(ValueError, match="l2_wait_s"):
        planner(FakeLookups(), Clock(), l2_wait_s=-1.0)


# -- runtime: two servers, one redis ------------------------------------------------------


def _need_redis() -> None:
    if redis_server_path() is None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                "CI=true but redis-server is not installed (.ci/install-redis.sh)", pytrace=False
            )
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


def _l2_server(url: str) -> ServerProcess:
    return ServerProcess(
        [
            "--chunk-size",
            str(CHUNK),
            "--separate-object-groups",
            "--eviction-policy",
            "LRU",
            "--l2-timeout-s",
            "2",
            "--l2",
            url,
        ],
        l1_size_gb=0.25,
    )


def _l2_stats(srv: ServerProcess) -> L2Report:
    with Client(srv.endpoint, timeout_s=10) as c:
        out = c.stats().l2
        assert out is not None, "the server runs without --l2"
        return out


def _wait_l2(
    srv: ServerProcess, done: Callable[[L2Report], bool], what: str, timeout_s: float = 30.0
) -> None:
    wait_for(lambda: done(_l2_stats(srv)), what, timeout_s)


def test_lookup_waits_for_l2_then_loads_byte_exact() -> None:
    """Server A stores a prefix (written behind to redis); the connector against server
    B (empty L1, same redis) first answers "not yet", a later step reports the whole
    prefix, and the worker loads into other blocks exactly the pages A stored."""
    _need_redis()
    fx = KVFixture.load(FIXTURES / "vllm-llama.json")
    arch = fx.arch or "cpu"
    tokens = [424_242 + i for i in range(2 * CHUNK + 40)]
    with (
        RedisProcess() as redis,
        _l2_server(redis.url) as a,
        _l2_server(redis.url) as b,
        ShmBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(fx, mem, a.endpoint, arch) as fa,
        ConnectorFlow(fx, mem, b.endpoint, arch) as fb,
    ):
        for srv in (a, b):
            _wait_l2(srv, lambda st: st.state == "up", "L2 connected")
        mem.fill_random(15)
        src = fa.tables(len(tokens))
        dst = fa.tables(len(tokens))  # one block pool for both flows: no overlap
        before = mem.snapshot()
        step, rep = fa.prefill("A", tokens, src)
        assert [s.n_chunks for s in step.stores] == [2] and rep.finished_sending == {"A"}
        n_objects = 2 * len(fa.work.reg.object_groups)
        _wait_l2(
            a,
            lambda st: bool(
                st.objects_written >= n_objects
                and st.write_queue_objects == 0
                and st.writes_in_flight == 0
            ),
            "L2 writes",
        )

        # generous bound: this test checks the wait ends because the chunks arrived
        fb.planner.l2.wait_s = 30.0
        hashes = block_hashes(tokens, fb.hash_block)
        answers: list[int | None] = []
        deadline = time.monotonic() + 30.0
        while True:  # one scheduler step per call
            got = fb.planner.matched_tokens("B", hashes, len(tokens), len(tokens), 0)
            answers.append(got)
            if got is not None:
                break
            assert time.monotonic() < deadline, "lookup never answered"
            time.sleep(0.002)
        assert answers[0] is None and answers[-1] == 2 * CHUNK, answers
        assert fb.planner.l2.waits >= 1, "the first answer did not wait for L2"
        assert fb.planner.l2.expired == 0

        fb.planner.after_alloc("B", dst, 2 * CHUNK)
        (load,) = fb.planner.build_step([]).loads
        assert load.n_chunks == 2 and load.lease_id
        rep = fb.load(load)
        assert rep.finished_recving == {"B"}
        assert not rep.failed_recving and not rep.invalid_block_ids
        fb.planner.transfers_finished(rep.finished_recving, [])
        fb.planner.request_finished("B")
        expected = mem.apply(before, fb.copies(load, src))
        assert mem.first_difference(expected, before) is not None
        bad = mem.first_difference(mem.snapshot(), expected)
        assert bad is None, f"byte {bad} differs: {describe_byte(fx.groups, bad)}"
        st = _l2_stats(b)
        assert st.hits >= n_objects and not st.invalid, st
