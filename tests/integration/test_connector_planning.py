"""Connector planning without vLLM: chunk arithmetic, the scheduler's lookup/lease/load/
store state machine, and the worker's exactly-once reports, against a real server."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import pytest

from lmc_server.client import Client
from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.integration.link.link import ServerLink
from lmc_server.integration.planning import SchedulerPlanner
from lmc_server.integration.plans import LookupAnswer, LookupBatch, ScheduledRequest
from lmc_server.integration.settings import ConnectorSettings
from lmc_server.integration.worker import TransferTracker, WorkerTransfers, failures_by_block_ids
from lmc_server.testing.connector_flow import block_hashes
from lmc_server.testing.kv import ShmKV
from lmc_server.testing.lookup_fakes import batch_of
from lmc_server.testing.presets import dsv41_flash, simple_model
from lmc_server.testing.process import ServerProcess

CHUNK = 256


def hashes(tokens: list[int], per: int = 16) -> list[bytes]:
    """Chained block hashes like an engine's (one per ``per`` tokens)."""
    return block_hashes(tokens, per)


def dsv_groups() -> list[EngineGroup]:
    return [
        EngineGroup("swa0", 32, window_tokens=128),
        EngineGroup("swa1", 32, window_tokens=128),
        EngineGroup("compressed", 64),
        EngineGroup("indexer", 64),
        EngineGroup("compressor_scratch", 8, cached=False),
    ]


class FakeLookups:
    """Lookups answered by hand: the test decides when a future completes."""

    def __init__(self) -> None:
        self.pending: list[tuple[bytes, Future[LookupAnswer]]] = []
        self.released: list[int] = []

    def lookup(self, digests: bytes) -> Future[LookupAnswer]:
        fut: Future[LookupAnswer] = Future()
        self.pending.append((digests, fut))
        return fut

    def lookup_batch(self, prefixes: Sequence[bytes]) -> list[Future[LookupAnswer]]:
        return [self.lookup(d) for d in prefixes]

    def lookup_hashed(self, chunks: Sequence[int], digests: Callable[[int], bytes]) -> LookupBatch:
        """Hashed here, on the caller's thread (the link does it on its own)."""
        return batch_of(self.lookup_batch([digests(i) for i in range(len(chunks))]))

    def release(self, lease_id: int) -> None:
        self.released.append(lease_id)


# -- chunk geometry ---------------------------------------------------------------------


def test_digests_follow_block_hashes_and_prefixes() -> None:
    g = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    a = list(range(1024))
    b = a[:512] + [7] * 512
    da, db = g.digests(hashes(a), 4), g.digests(hashes(b), 4)
    assert len(da) == 4 * 32
    assert da[:64] == db[:64] and da[64:96] != db[64:96]
    assert g.digests(hashes(a), 2) == da[:64]
    with pytest.raises(ValueError):
        g.digests(hashes(a)[:15], 1)


def test_max_chunks_never_claims_last_token() -> None:
    g = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    assert g.max_chunks(256, 16) == 0
    assert g.max_chunks(257, 16) == 1
    assert g.max_chunks(513, 32) == 2
    assert g.max_chunks(513, 20) == 1  # only hashed chunks


def test_block_ids_sliced_per_group_scratch_null_and_kept() -> None:
    g = ChunkGeometry(CHUNK, 32, dsv_groups())
    tables = [
        list(range(100, 116)),
        list(range(200, 216)),
        list(range(300, 308)),
        list(range(400, 408)),
        [9],
    ]
    tables[0][9] = 0  # vLLM's null block: a sliding-window block already dropped
    ids = g.block_ids(tables, 1, 1)
    assert set(ids) == {"swa0", "swa1", "compressed", "indexer"}
    assert ids["swa0"].tolist() == [108, -1] + list(range(110, 116))
    assert ids["compressed"].tolist() == [304, 305, 306, 307]
    kept = g.block_ids(tables, 0, 2, keep_tokens=320)
    assert kept["compressed"].tolist() == [-1] * 5 + [305, 306, 307]
    assert kept["swa1"].tolist() == [-1] * 10 + list(range(210, 216))
    short = g.block_ids([t[:3] for t in tables], 0, 1)
    assert short["indexer"].tolist() == [400, 401, 402, -1]


class Block:
    """An engine's block object (vLLM's ``KVCacheBlock``): the planner reads its id."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


def ids_of(blocks: Sequence[Block]) -> list[int]:
    return [b.block_id for b in blocks]


def test_a_steps_loads_planned_together_get_each_loads_own_block_ids() -> None:
    """A step's loads planned together (one array per group, read once,
    :class:`StepLoads`) give each load exactly what ``block_ids`` gives it alone:
    random tables with null blocks, tables shorter than the load, blocks the engine
    holds, server groups sharing a table, tables of ids or of the engine's block
    objects, both in one step; the engine changing a table after the allocation does
    not move its load; and no load's ids alias another's (marking one leaves the
    others alone)."""
    import copy
    import random

    from lmc_server.cache.keys import DIGEST_BYTES
    from lmc_server.integration.loads import LoadPlanner
    from lmc_server.integration.tracked import Tracked

    groups = [*dsv_groups(), EngineGroup("mla", 16, server_groups=("mla_k", "mla_v"))]
    g = ChunkGeometry(CHUNK, 32, groups)
    rng = random.Random(7)
    for mixed in (False, True):
        planner = LoadPlanner(g)
        loads = []
        for i in range(40):
            n = rng.randint(1, 4)
            tables = []
            for eg in groups:
                per = CHUNK // eg.tokens_per_block if eg.cached else 1
                size = n * per - (rng.randint(1, per) if rng.random() < 0.2 else 0)
                table = [rng.randrange(0, 5000) for _ in range(max(0, size))]
                if table and rng.random() < 0.3:
                    table[rng.randrange(len(table))] = 0  # vLLM's null block
                tables.append(table)
            keep = rng.choice([0, 0, CHUNK, 100, n * CHUNK - 16])
            r = Tracked(f"r{i}", [], 0, digests=bytes([i]) * (n * DIGEST_BYTES), lease_id=i)
            as_objects = not mixed or i % 3 == 0
            engine_tables: list[list[Any]] = [
                [Block(b) for b in t] if as_objects else list(t) for t in tables
            ]
            planner.queue(r, n, keep, engine_tables, ids_of if as_objects else None)
            for t in engine_tables:  # the engine reuses its tables after the allocation
                t.reverse()
            loads.append((tables, n, keep))
        together = planner.take()
        assert len(together) == len(loads)
        for i, ((tables, n, keep), spec) in enumerate(zip(loads, together, strict=True)):
            assert (spec.req_id, spec.lease_id, spec.n_chunks) == (f"r{i}", i, n)
            assert spec.digests == bytes([i]) * (n * DIGEST_BYTES)
            alone = g.block_ids(tables, 0, n, keep_tokens=keep)
            assert set(spec.block_ids) == set(alone)
            for key in alone:
                assert spec.block_ids[key].dtype == alone[key].dtype
                assert spec.block_ids[key].tolist() == alone[key].tolist(), key
        # vLLM hands plans to its worker processes by value: copied through the
        # object's reduce protocol (what serializing it needs), it reads the same
        again = copy.deepcopy(together)
        assert [(s.req_id, s.digests, s.lease_id) for s in again] == [
            (s.req_id, s.digests, s.lease_id) for s in together
        ]
        assert [s.block_ids["mla_v"].tolist() for s in again] == [
            s.block_ids["mla_v"].tolist() for s in together
        ]
        first = together[0].block_ids["compressed"]
        before = [spec.block_ids["compressed"].tolist() for spec in together[1:]]
        first[:] = -7
        assert [spec.block_ids["compressed"].tolist() for spec in together[1:]] == before
        assert together[-1].req_id == together[len(loads) - 1].req_id
        assert [s.req_id for s in together[1:3]] == ["r1", "r2"]
        assert list(planner.take()) == []


def test_first_window_block_a_store_reads() -> None:
    """Per window group, the lowest table index a store of chunks 1..2 reads: only the
    last 4 blocks of each chunk (128-token window, 32 tokens per block), not ``-1``s."""
    g = ChunkGeometry(CHUNK, 32, dsv_groups())
    tables = [
        list(range(100, 124)),
        list(range(200, 224)),
        list(range(300, 312)),
        list(range(400, 412)),
        [9],
    ]
    ids = g.block_ids(tables, 1, 2)
    ids["swa0"][:13] = -1  # chunk 1's window and the first window block of chunk 2
    assert g.first_window_blocks(ids, 1, 2) == {0: 2 * 8 + 4 + 1, 1: 8 + 4}
    ids["swa1"][:] = -1
    assert g.first_window_blocks(ids, 1, 2) == {0: 21}


def test_chunk_size_must_fit_every_cached_group() -> None:
    with pytest.raises(ValueError, match="'compressed'"):
        ChunkGeometry(96, 32, dsv_groups())
    with pytest.raises(ValueError, match="hash block size"):
        ChunkGeometry(256, 48, [EngineGroup("full", 16)])


def test_settings_from_extra_config() -> None:
    s = ConnectorSettings.from_extra(
        {
            "lmcache.mp.host": "::1",
            "lmcache.mp.port": "6000",
            "lmcache.mp.store": "false",
            "other.key": 1,
        }
    )
    assert s.endpoint == "tcp://[::1]:6000" and s.store is False
    with pytest.raises(ValueError, match="lmcache.mp.prot"):
        ConnectorSettings.from_extra({"lmcache.mp.prot": 1})
    with pytest.raises(ValueError, match="boolean"):
        ConnectorSettings.from_extra({"lmcache.mp.load": "maybe"})


# -- scheduler planner (hand-driven lookups) ----------------------------------------------


def test_lookup_is_async_rounded_and_leased() -> None:
    svc = FakeLookups()
    p = SchedulerPlanner(ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc)
    h = hashes(list(range(800)))
    assert p.matched_tokens("r", h, 800, 800, 0) is None
    assert p.matched_tokens("r", h, 800, 800, 0) is None
    assert len(svc.pending) == 1 and len(svc.pending[0][0]) == 3 * 32
    svc.pending[0][1].set_result(LookupAnswer(2, 11, 30.0))
    assert p.matched_tokens("r", h, 800, 800, 0) == 512
    assert p.matched_tokens("r", h, 800, 800, 0) == 512  # idempotent
    assert p.matched_tokens("r", h, 800, 800, 256) == 256  # engine holds chunk 0
    assert svc.released == []
    # the engine's own prefix cache covers the hit: nothing to load, lease released
    assert p.matched_tokens("r", h, 800, 800, 512) == 0
    assert svc.released == [11]


def test_stale_lease_is_refreshed() -> None:
    now = [0.0]
    svc = FakeLookups()
    p = SchedulerPlanner(
        ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc, clock=lambda: now[0]
    )
    h = hashes(list(range(600)))
    p.matched_tokens("r", h, 600, 600, 0)
    svc.pending[0][1].set_result(LookupAnswer(2, 5, 10.0))
    assert p.matched_tokens("r", h, 600, 600, 0) == 512
    now[0] = 6.0
    assert p.matched_tokens("r", h, 600, 600, 0) is None
    assert svc.released == [5] and len(svc.pending) == 2


def test_abort_during_lookup_releases_the_late_lease() -> None:
    svc = FakeLookups()
    p = SchedulerPlanner(ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc)
    h = hashes(list(range(600)))
    assert p.matched_tokens("r", h, 600, 600, 0) is None
    assert p.request_finished("r") is False
    svc.pending[0][1].set_result(LookupAnswer(2, 9, 30.0))
    # released when the answer came, with no further call (an idle engine makes none)
    assert svc.released == [9] and p.tracked == 0


class AnsweringLookups(FakeLookups):
    """Lookups answered as they are sent (a server within the bound), ``hit`` chunks;
    counts the batches."""

    def __init__(self, hit: int = 0) -> None:
        super().__init__()
        self.hit = hit
        self.batches: list[int] = []

    def lookup_batch(self, prefixes: Sequence[bytes]) -> list[Future[LookupAnswer]]:
        self.batches.append(len(prefixes))
        futs = super().lookup_batch(prefixes)
        for f in futs:
            f.set_result(LookupAnswer(self.hit, 7 if self.hit else 0, 30.0))
        return futs


def test_arrived_requests_are_looked_up_together_and_answered_at_once() -> None:
    """Lookups of the requests that arrived before a step go out in one batch at the
    step's first call; an answer within the bound is returned at once (no "ask
    again"); a request shorter than a chunk is not looked up; a request that ends
    before its queued lookup went out is never looked up."""
    svc = AnsweringLookups(hit=2)
    p = SchedulerPlanner(
        ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc, lookup_wait_s=0.001
    )
    h = hashes(list(range(600)))
    for i in range(5):
        p.request_arrived(f"r{i}", h, 600, 600)
    p.request_arrived("short", hashes(list(range(200))), 200, 200)
    p.request_arrived("gone", h, 600, 600)
    assert p.request_finished("gone") is False
    assert p.lookups_in_flight == 5
    assert p.matched_tokens("r0", h, 600, 600, 0) == 512
    assert svc.batches == [5]
    assert [p.matched_tokens(f"r{i}", h, 600, 600, 0) for i in range(1, 5)] == [512] * 4
    assert svc.batches == [5] and p.lookups_answered_at_once == 5
    assert p.matched_tokens("short", hashes(list(range(200))), 200, 200, 0) == 0
    assert svc.batches == [5]


def test_an_arrival_that_ends_before_its_lookup_went_out_leaves_the_others_theirs() -> None:
    """Arrivals whose lookups wait to go out together: one in the middle ends first; the
    others' lookups go out without it, and each request gets its own answer."""
    svc = FakeLookups()
    p = SchedulerPlanner(
        ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc, lookup_wait_s=0.001
    )
    prompts = {f"r{i}": hashes([1000 * i + t for t in range(600)]) for i in range(5)}
    for rid, h in prompts.items():
        p.request_arrived(rid, h, 600, 600)
    assert p.request_finished("r1") is False
    assert p.matched_tokens("r0", prompts["r0"], 600, 600, 0) is None  # sent, not answered
    sent = {d: fut for d, fut in svc.pending}
    assert len(sent) == 4
    geometry = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    for lease, rid in enumerate(("r0", "r2", "r3", "r4"), start=1):
        sent[geometry.digests(prompts[rid], 2)].set_result(LookupAnswer(lease % 3, lease, 30.0))
    got = {
        rid: p.matched_tokens(rid, prompts[rid], 600, 600, 0) for rid in ("r0", "r2", "r3", "r4")
    }
    assert got == {"r0": 256, "r2": 512, "r3": 0, "r4": 256}
    assert svc.released == [3]  # r3's answer (no hit) gives its lease back


def test_an_arrival_noted_twice_or_already_looked_up_gets_one_lookup() -> None:
    """The step's arrivals are admitted in one pass when each is new and distinct;
    otherwise one by one: a request noted twice is looked up once, one whose answer
    stands is not looked up again, and each request reads its own answer."""
    svc = FakeLookups()
    geometry = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    p = SchedulerPlanner(geometry, svc, lookup_wait_s=0.001)
    prompts = {f"r{i}": hashes([1000 * i + t for t in range(600)]) for i in range(3)}
    p.request_arrived("r0", prompts["r0"], 600, 600)
    assert p.matched_tokens("r0", prompts["r0"], 600, 600, 0) is None
    svc.pending[0][1].set_result(LookupAnswer(1, 5, 30.0))
    assert p.matched_tokens("r0", prompts["r0"], 600, 600, 0) == 256
    for rid in ("r1", "r0", "r2", "r1"):
        p.request_arrived(rid, prompts[rid], 600, 600)
    assert p.matched_tokens("r1", prompts["r1"], 600, 600, 0) is None
    assert [d for d, _ in svc.pending[1:]] == [
        geometry.digests(prompts[r], 2) for r in ("r1", "r2")
    ]
    svc.pending[1][1].set_result(LookupAnswer(2, 6, 30.0))
    svc.pending[2][1].set_result(LookupAnswer(0, 0, 30.0))
    got = [p.matched_tokens(rid, prompts[rid], 600, 600, 0) for rid in ("r0", "r1", "r2")]
    assert got == [256, 512, 0] and svc.released == []
    p.build_step([])
    more = {f"r{i}": hashes([1000 * i + t for t in range(600)]) for i in (3, 4)}
    for rid in ("r3", "r4", "r3"):  # all new: one of them noted twice
        p.request_arrived(rid, more[rid], 600, 600)
    assert p.matched_tokens("r3", more["r3"], 600, 600, 0) is None
    assert [d for d, _ in svc.pending[3:]] == [geometry.digests(more[r], 2) for r in ("r3", "r4")]


def test_lookup_waits_are_bounded_per_step_not_per_request() -> None:
    """A server that does not answer: the first call of a step waits out the step's
    budget, the other requests of the step do not wait again; every call answers
    "ask again"; the next step has a new budget; the answers, once in, are returned."""
    svc = FakeLookups()
    p = SchedulerPlanner(
        ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc, lookup_wait_s=0.05
    )
    h = hashes(list(range(600)))
    for i in range(20):
        p.request_arrived(f"r{i}", h, 600, 600)
    t0 = time.monotonic()
    assert [p.matched_tokens(f"r{i}", h, 600, 600, 0) for i in range(20)] == [None] * 20
    took_s = time.monotonic() - t0
    assert 0.05 <= took_s < 0.5  # one budget, not 20 (1 s)
    p.build_step([])
    t0 = time.monotonic()
    assert p.matched_tokens("r0", h, 600, 600, 0) is None
    assert time.monotonic() - t0 >= 0.05  # a new step, a new budget
    for _, fut in svc.pending:
        fut.set_result(LookupAnswer(1, 3, 30.0))
    assert p.matched_tokens("r1", h, 600, 600, 0) == 256
    assert p.lookups_answered_at_once == 0


def test_wait_settings() -> None:
    s = ConnectorSettings.from_extra({})
    assert (s.lookup_wait_s, s.idle_load_wait_s) == (0.005, 0.01)
    s = ConnectorSettings.from_extra(
        {"lmcache.mp.lookup_wait_s": "0", "lmcache.mp.idle_load_wait_s": 0.1}
    )
    assert (s.lookup_wait_s, s.idle_load_wait_s) == (0.0, 0.1)
    for key in ("lookup_wait_s", "idle_load_wait_s"):
        for bad in (-0.001, 0.2, "nan"):
            with pytest.raises(ValueError, match=key):
                ConnectorSettings.from_extra({f"lmcache.mp.{key}": bad})
    with pytest.raises(ValueError, match="lookup_wait_s"):
        SchedulerPlanner(
            ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), FakeLookups(), lookup_wait_s=-1.0
        )


def test_a_load_writes_the_tables_as_allocated_copied() -> None:
    """The planner copies the engine's tables: the caller changing its list after the
    allocation cannot move a load into other blocks."""
    g = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    h = hashes(list(range(1100)))
    svc = FakeLookups()
    p = SchedulerPlanner(g, svc)
    p.matched_tokens("r", h, 1100, 1100, 0)
    svc.pending[0][1].set_result(LookupAnswer(2, 7, 30.0))
    assert p.matched_tokens("r", h, 1100, 1100, 0) == 512
    table = list(range(1, 70))
    p.after_alloc("r", [table], 512)
    table[:32] = range(100, 132)  # the caller reuses its list
    (load,) = p.build_step([]).loads
    assert load.block_ids["full"].tolist() == list(range(1, 33))
    assert load.lease_id == 7


def test_load_then_store_plan_and_hold_rules() -> None:
    svc = FakeLookups()
    g = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    p = SchedulerPlanner(g, svc)
    h = hashes(list(range(1100)))
    p.matched_tokens("r", h, 1100, 1100, 256)
    svc.pending[0][1].set_result(LookupAnswer(3, 4, 30.0))
    assert p.matched_tokens("r", h, 1100, 1100, 256) == 512
    blocks = [list(range(1, 70))]
    p.after_alloc("r", blocks, 512)
    plan = p.build_step([])
    (load,) = plan.loads
    assert load.n_chunks == 3 and load.lease_id == 4
    assert load.block_ids["full"].tolist() == [-1] * 16 + list(range(17, 49))
    # aborted while loading: blocks held until every worker reported the load
    assert p.request_finished("r") is True
    assert svc.released == []
    p.transfers_finished(["r"], [])
    assert svc.released == [4] and p.tracked == 0

    # a fresh request: prefill in two steps stores each completed chunk once
    svc2 = FakeLookups()
    p2 = SchedulerPlanner(g, svc2)
    p2.matched_tokens("s", h, 1100, 1100, 0)
    svc2.pending[0][1].set_result(LookupAnswer(0, 0, 30.0))
    assert p2.matched_tokens("s", h, 1100, 1100, 0) == 0
    p2.after_alloc("s", [list(range(1, 33))], 0)
    s1 = p2.build_step([ScheduledRequest("s", 0, 512, [list(range(1, 33))], True)])
    assert [(s.first_chunk, s.n_chunks) for s in s1.stores] == [(0, 2)]
    assert s1.stores[0].digests == g.digests(h, 2) and not s1.fence_store_ids
    s2 = p2.build_step([ScheduledRequest("s", 512, 588, [list(range(33, 70))])])
    assert [(s.first_chunk, s.n_chunks) for s in s2.stores] == [(2, 2)]
    assert s2.stores[0].block_ids["full"].tolist() == list(range(33, 65))
    assert p2.build_step([ScheduledRequest("s", 1100, 1, None)]).stores == []
    assert p2.request_finished("s") is True
    p2.transfers_finished([], ["s"])
    assert p2.tracked == 0


def _dsv_request(
    p: SchedulerPlanner, svc: FakeLookups, req_id: str, n_tokens: int, hit_chunks: int = 0
) -> list[bytes]:
    h = hashes(list(range(n_tokens)), per=32)
    p.matched_tokens(req_id, h, n_tokens, n_tokens, 0)
    svc.pending[-1][1].set_result(LookupAnswer(hit_chunks, 0, 30.0))
    p.matched_tokens(req_id, h, n_tokens, n_tokens, 0)
    return h


DSV_TABLES = [
    list(range(1, 33)),
    list(range(40, 72)),
    list(range(80, 96)),
    list(range(100, 116)),
    [5],
]


@pytest.mark.parametrize("first_step", [512, 500, 700])
def test_store_fenced_in_the_first_step_that_may_free_its_blocks(first_step: int) -> None:
    """Whatever the step boundaries, a store is fenced in the first step
    whose scheduling may free a block it reads (vLLM frees sliding-window blocks
    wholly below ``computed - W + 1``), and never earlier than needed."""
    svc = FakeLookups()
    g = ChunkGeometry(CHUNK, 32, dsv_groups())
    p = SchedulerPlanner(g, svc)
    _dsv_request(p, svc, "w", 1000)
    p.after_alloc("w", DSV_TABLES, 0)
    plan = p.build_step([ScheduledRequest("w", 0, first_step, DSV_TABLES, True)])
    stores = {s.store_id: s for s in plan.stores}
    assert not plan.fence_store_ids and "compressor_scratch" not in plan.stores[0].block_ids
    computed, fenced = first_step, set[int]()
    while computed < 1000 and len(fenced) < len(stores):
        plan = p.build_step([ScheduledRequest("w", computed, 1, None)])
        stores.update({s.store_id: s for s in plan.stores})
        freed = g.freed_blocks(g.groups[0], computed)
        for sid, st in stores.items():  # each window block a store reads, in the table
            k0 = st.first_chunk
            reads = [
                (k0 + k) * 8 + j
                for k in range(st.n_chunks)
                for j in range(4, 8)
                if st.block_ids["swa0"][k * 8 + j] >= 0
            ]
            must = bool(reads) and min(reads) < freed and sid not in fenced
            assert (sid in plan.fence_store_ids) == must, (computed, sid)
            if must:
                fenced.add(sid)
        computed += 1
    assert fenced == set(stores)  # every store with window blocks is fenced in time
    # a preemption frees every block: the request's unfenced stores are fenced
    p2 = SchedulerPlanner(ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc)
    h = hashes(list(range(600)))
    p2.matched_tokens("f", h, 600, 600, 0)
    svc.pending[-1][1].set_result(LookupAnswer(0, 0, 30.0))
    p2.matched_tokens("f", h, 600, 600, 0)
    p2.after_alloc("f", [list(range(1, 40))], 0)
    (st,) = p2.build_step([ScheduledRequest("f", 0, 600, [list(range(1, 40))], True)]).stores
    assert not p2.build_step([ScheduledRequest("f", 600, 1, None)]).fence_store_ids
    assert p2.build_step([], preempted_req_ids=["f"]).fence_store_ids == {st.store_id}


def test_store_never_reads_blocks_already_freed() -> None:
    """A store planned after some of its window blocks left the window (the
    engine hashed the chunk's last tokens late, as under async scheduling) sends
    them as -1: vLLM may have reused them already."""
    svc = FakeLookups()
    g = ChunkGeometry(CHUNK, 32, dsv_groups())
    p = SchedulerPlanner(g, svc)
    tokens = list(range(600))
    h = _dsv_request(p, svc, "w", 600)
    p.after_alloc("w", DSV_TABLES, 0)
    (st,) = p.build_step([ScheduledRequest("w", 0, 600, DSV_TABLES, True)]).stores
    assert (st.first_chunk, st.n_chunks) == (0, 2)
    for pos in range(600, 900):  # hashes of generated tokens not there yet
        assert p.build_step([ScheduledRequest("w", pos, 1, None)]).stores == []
    tokens += list(range(600, 900))
    h[:] = hashes(tokens, per=32)
    assert g.freed_blocks(g.groups[0], 900) == 24
    (late,) = p.build_step([ScheduledRequest("w", 900, 1, None)]).stores
    assert (late.first_chunk, late.n_chunks) == (2, 1)
    assert late.block_ids["swa0"].tolist() == [-1] * 8
    assert late.block_ids["compressed"].tolist() == DSV_TABLES[2][8:12]


def test_chunks_the_server_lacks_are_stored_even_if_the_engine_holds_them() -> None:
    """vLLM's prefix cache holds 3 chunks, the server reported 1 (it evicted
    or lost the rest): chunks 1.. are stored, not assumed stored."""
    svc = FakeLookups()
    g = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    p = SchedulerPlanner(g, svc)
    h = hashes(list(range(1100)))
    assert p.matched_tokens("r", h, 1100, 1100, 768) is None
    svc.pending[0][1].set_result(LookupAnswer(1, 3, 30.0))
    assert p.matched_tokens("r", h, 1100, 1100, 768) == 0
    assert svc.released == [3]
    blocks = [list(range(1, 70))]
    p.after_alloc("r", blocks, 0)
    (st,) = p.build_step([ScheduledRequest("r", 768, 332, blocks, True)]).stores
    assert (st.first_chunk, st.n_chunks) == (1, 3)
    assert st.block_ids["full"].tolist() == list(range(17, 65))
    # no lookup at all (the engine holds every whole chunk): every chunk is offered
    p2 = SchedulerPlanner(g, FakeLookups())
    h = hashes(list(range(1000)))
    assert p2.matched_tokens("s", h, 1000, 1000, 768) == 0
    p2.after_alloc("s", blocks, 0)
    (st,) = p2.build_step([ScheduledRequest("s", 768, 232, blocks, True)]).stores
    assert (st.first_chunk, st.n_chunks) == (0, 3)


def test_hit_not_taken_releases_its_lease_at_once() -> None:
    """vLLM dropped the hit after the lookup (0 external tokens: a partial
    tail, skip_reading_prefix_cache, a replay): the lease goes back now."""
    svc = FakeLookups()
    p = SchedulerPlanner(ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)]), svc)
    h = hashes(list(range(800)))
    p.matched_tokens("r", h, 800, 800, 0)
    svc.pending[0][1].set_result(LookupAnswer(2, 21, 30.0))
    assert p.matched_tokens("r", h, 800, 800, 0) == 512
    p.after_alloc("r", [list(range(1, 51))], 0)
    assert svc.released == [21]
    assert p.build_step([]).loads == []
    assert p.request_finished("r") is False and svc.released == [21]


@pytest.mark.parametrize("store_generated", [True, False])
def test_generated_chunks_are_stored(store_generated: bool) -> None:
    """Whole chunks of generated tokens are stored (the next turn's prompt
    holds them), unless turned off; chunks still missing at the end are stored by a
    final store while the blocks are held."""
    svc = FakeLookups()
    g = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    p = SchedulerPlanner(g, svc, store_generated=store_generated)
    tokens = list(range(300))
    h = hashes(tokens)
    p.matched_tokens("r", h, 300, 300, 0)
    svc.pending[0][1].set_result(LookupAnswer(0, 0, 30.0))
    p.matched_tokens("r", h, 300, 300, 0)
    blocks = [list(range(1, 21))]
    p.after_alloc("r", blocks, 0)
    (st,) = p.build_step([ScheduledRequest("r", 0, 300, blocks, True)]).stores
    assert st.n_chunks == 1
    stored = []
    for pos in range(300, 520):  # decode: one token a step; the engine hashes them
        tokens.append(pos)
        h[:] = hashes(tokens)
        stored += [
            (s.first_chunk, s.n_chunks)
            for s in p.build_step(
                [
                    ScheduledRequest(
                        "r", pos, 1, [[21 + (pos - 300) // 16]] if pos % 16 == 0 else None
                    )
                ]
            ).stores
        ]
    assert stored == ([(1, 1)] if store_generated else [])
    assert p.request_finished("r") is True
    assert p.build_step([]).stores == []


# -- against a real server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(
        ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"],
        l1_size_gb=0.5,
    ) as s:
        yield s


def _link(srv: ServerProcess, kv: ShmKV, buffers: bool) -> ServerLink:
    link = ServerLink(srv.endpoint, timeout_s=20)
    link.register(**kv.register_kwargs(buffers=kv.buffers if buffers else [], replicated=True))
    return link


@pytest.mark.parametrize("preset", ["dsv41", "simple"])
def test_store_then_load_byte_exact(srv: ServerProcess, preset: str) -> None:
    geo = (
        dsv41_flash(num_blocks=128, layers=6) if preset == "dsv41" else simple_model(num_blocks=128)
    )
    with ShmKV(geo) as kv:
        kv.fill_random(1)
        sched, work = _link(srv, kv, False), _link(srv, kv, True)
        try:
            groups = [
                EngineGroup(gs.name, gs.tokens_per_block, gs.cached, gs.window_tokens)
                for gs in geo.groups
            ]
            per = min(gs.tokens_per_block for gs in geo.groups if gs.cached)
            g = ChunkGeometry(256, per, groups)
            planner = SchedulerPlanner(g, sched)
            tracker = TransferTracker(by_block_ids=failures_by_block_ids(groups))
            wt = WorkerTransfers(work, tracker)
            toks = list(range(5000, 5000 + 700))
            h = hashes(toks, per)

            def tables(offset: int) -> list[list[int]]:
                return [
                    list(range(offset, offset + 700 // gs.tokens_per_block + 1))
                    if gs.cached
                    else [1]
                    for gs in geo.groups
                ]

            # request A computes its prompt; its two full chunks are stored
            while (n := planner.matched_tokens("A", h, 700, 700, 0)) is None:
                pass
            assert n == 0
            planner.after_alloc("A", tables(1), 0)
            plan = planner.build_step([ScheduledRequest("A", 0, 700, tables(1), True)])
            wt.begin_step(plan)
            wt.start_stores(plan.stores)
            assert wt.fence([]) and wt.fence(s.store_id for s in plan.stores)
            assert planner.request_finished("A") is True
            rep = tracker.poll({"A"})
            assert rep.finished_sending == {"A"}
            assert tracker.poll(set()).finished_sending == set()  # exactly once
            planner.transfers_finished([], rep.finished_sending)

            # request B, same prompt: hit of 2 chunks, loaded into other blocks
            while (n := planner.matched_tokens("B", h, 700, 700, 0)) is None:
                pass
            assert n == 512
            planner.after_alloc("B", tables(64), 512)
            plan = planner.build_step([])
            wt.begin_step(plan)
            (load,) = plan.loads
            rep = tracker.poll(set())
            while not rep.finished_recving:
                tracker._loads["B"].future.result(10)
                rep = tracker.poll(set())
            assert rep.finished_recving == {"B"} and not rep.failed_recving
            assert not rep.invalid_block_ids
            for gs in geo.groups:
                if not gs.cached:
                    continue
                src = g.block_ids(tables(1), 0, 2)[gs.name]
                dst = load.block_ids[gs.name]
                if gs.kind == "sliding_window":  # only the window of the last chunk
                    nwin = gs.window_tokens // gs.tokens_per_block
                    src, dst = src[-nwin:], dst[-nwin:]
                assert kv.pages(gs.name, dst.tolist()) == kv.pages(gs.name, src.tolist())
            planner.transfers_finished(rep.finished_recving, [])
            assert planner.request_finished("B") is False
            assert planner.tracked == 0
        finally:
            sched.close()
            work.close()


@pytest.mark.parametrize("preset", ["dsv41", "simple"])
def test_failed_load_is_reported_not_success(srv: ServerProcess, preset: str) -> None:
    geo = (
        dsv41_flash(num_blocks=128, layers=6) if preset == "dsv41" else simple_model(num_blocks=128)
    )
    with ShmKV(geo) as kv:
        work = _link(srv, kv, True)
        try:
            per = min(gs.tokens_per_block for gs in geo.groups if gs.cached)
            groups = [
                EngineGroup(gs.name, gs.tokens_per_block, gs.cached, gs.window_tokens)
                for gs in geo.groups
            ]
            g = ChunkGeometry(256, per, groups)
            tracker = TransferTracker(by_block_ids=failures_by_block_ids(groups))
            wt = WorkerTransfers(work, tracker)
            digests = g.digests(hashes(list(range(9000, 9600)), per), 2)  # never stored
            tables = [list(range(1, 30)) if gs.cached else [1] for gs in geo.groups]
            from lmc_server.integration.plans import LoadSpec, StepPlan

            spec = LoadSpec("C", digests, g.block_ids(tables, 0, 2), 0)
            wt.begin_step(StepPlan(loads=[spec]))
            tracker._loads["C"].future.result(10)
            rep = tracker.poll(set())
            assert rep.finished_recving == {"C"}
            if len(geo.groups) == 1:
                assert rep.invalid_block_ids == set(range(1, 33)) & set(
                    spec.block_ids["full"].tolist()
                )
                assert not rep.failed_recving
            else:
                assert rep.failed_recving == {"C"}
            assert tracker.poll(set()).finished_recving == set()
        finally:
            work.close()
    with Client(srv.endpoint) as c:
        assert c.stats()  # the server is still serving
