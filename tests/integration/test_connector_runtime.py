"""The connector's planner and worker against a real server process, without vLLM:
a stalled server (a store must finish before vLLM may rewrite the blocks it reads),
a hundred requests hitting in one step (no transient failure, one request per step),
and shutdown with stores in flight.

The engine is played by hand: block tables, scheduled tokens and the forward pass's
writes (``ShmKV`` pages) follow vLLM 0.33's rules; tests/vllm drives the same code
with vLLM's own scheduler.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from lmc_server.client import Client
from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.integration.link.link import ServerLink
from lmc_server.integration.planning import SchedulerPlanner
from lmc_server.integration.plans import ScheduledRequest
from lmc_server.integration.worker import (
    Report,
    TransferTracker,
    WorkerTransfers,
    failures_by_block_ids,
)
from lmc_server.testing.connector_flow import block_hashes, check_batched_step
from lmc_server.testing.kv import KVGeometry, ShmKV
from lmc_server.testing.presets import dsv41_flash, simple_model
from lmc_server.testing.process import ServerProcess

CHUNK = 256


@dataclass
class Rig:
    """One scheduler planner and one worker over ``kv``, on their own connections."""

    geo: KVGeometry
    kv: ShmKV
    sched: ServerLink
    work: ServerLink
    geometry: ChunkGeometry
    planner: SchedulerPlanner
    tracker: TransferTracker
    wt: WorkerTransfers
    per: int

    @classmethod
    def open(cls, endpoint: str, geo: KVGeometry, kv: ShmKV) -> Rig:
        kw: dict[str, Any] = dict(replicated=True)
        sched = ServerLink(endpoint, timeout_s=20)
        work = ServerLink(endpoint, timeout_s=20)
        sched.register(**kv.register_kwargs(buffers=[], **kw))
        work.register(**kv.register_kwargs(buffers=kv.buffers, **kw))
        groups = [
            EngineGroup(g.name, g.tokens_per_block, g.cached, g.window_tokens) for g in geo.groups
        ]
        per = min(g.tokens_per_block for g in geo.groups if g.cached)
        geometry = ChunkGeometry(CHUNK, per, groups)
        tracker = TransferTracker(by_block_ids=failures_by_block_ids(groups))
        return cls(
            geo,
            kv,
            sched,
            work,
            geometry,
            SchedulerPlanner(geometry, sched),
            tracker,
            WorkerTransfers(work, tracker),
            per,
        )

    def close(self) -> None:
        self.sched.close()
        self.work.close()

    def matched(self, req_id: str, tokens: list[int]) -> int:
        h = block_hashes(tokens, self.per)
        deadline = time.monotonic() + 20
        while (n := self.planner.matched_tokens(req_id, h, len(tokens), len(tokens), 0)) is None:
            assert time.monotonic() < deadline, "lookup never answered"
            time.sleep(0.002)
        return n

    def poll(self, finished: set[str], want: str, n: int = 1) -> Report:
        rep = Report()
        deadline = time.monotonic() + 30
        while len(getattr(rep, want)) < n:
            r = self.tracker.poll(finished)
            for f in (
                "finished_sending",
                "finished_recving",
                "failed_recving",
                "invalid_block_ids",
            ):
                getattr(rep, f).update(getattr(r, f))
            assert time.monotonic() < deadline, f"{want}: {len(getattr(rep, want))} of {n}"
            time.sleep(0.002)
        return rep


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(
        ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"],
        l1_size_gb=0.25,
    ) as s:
        yield s


def _tables(geo: KVGeometry, first: int, num_tokens: int) -> list[list[int]]:
    return [
        list(range(first, first + -(-num_tokens // g.tokens_per_block))) if g.cached else [first]
        for g in geo.groups
    ]


def test_store_finishes_before_freed_window_blocks_are_rewritten(srv: ServerProcess) -> None:
    """A 512-token prefill step ends exactly on a chunk boundary; at the next
    step vLLM frees chunk 0's sliding-window blocks (they left the window) and may hand
    them to another request, whose forward pass writes them. With the server stopped
    (SIGSTOP) the store of chunk 0 cannot run before that write: the step must wait
    for it, or chunk 0's window object holds the other request's bytes."""
    geo = dsv41_flash(num_blocks=96, layers=4)
    with ShmKV(geo) as kv:
        kv.fill_random(7)
        rig = Rig.open(srv.endpoint, geo, kv)
        try:
            tokens = list(range(100, 100 + 600))
            assert rig.matched("A", tokens) == 0
            a = _tables(geo, 1, 600)
            rig.planner.after_alloc("A", a, 0)
            step1 = rig.planner.build_step([ScheduledRequest("A", 0, 512, a, True)])
            assert [s.n_chunks for s in step1.stores] == [2]
            swa = [g for g in geo.groups if g.kind == "sliding_window"]
            window0 = {g.name: a[geo.groups.index(g)][4:8] for g in swa}  # chunk 0's window
            before = {n: kv.pages(n, ids) for n, ids in window0.items()}
            rig.wt.begin_step(step1)
            assert srv.proc is not None
            os.kill(srv.proc.pid, signal.SIGSTOP)
            resume = threading.Timer(3.0, os.kill, (srv.proc.pid, signal.SIGCONT))
            resume.start()
            try:
                rig.wt.start_stores(step1.stores)  # after step 1's forward pass
                # step 2: one more token; chunk 0's window blocks leave the window
                step2 = rig.planner.build_step([ScheduledRequest("A", 512, 1, None)])
                t0 = time.monotonic()
                rig.wt.begin_step(step2)
                waited = time.monotonic() - t0
                # step 2's forward pass: another request was given the freed blocks
                for n, ids in window0.items():
                    for li in range(len(kv.group(n).layers)):
                        for b in ids:
                            kv.page(n, li, b)[:] = 0xEE
            finally:
                resume.join()
                os.kill(srv.proc.pid, signal.SIGCONT)
            rig.tracker.store_futures()[0].result(20)
            assert rig.planner.request_finished("A") is True

            # B: the first chunk only, loaded into fresh blocks: its window must be A's
            b_tokens = tokens[:257]
            assert rig.matched("B", b_tokens) == 256
            b_tables = _tables(geo, 40, 257)
            rig.planner.after_alloc("B", b_tables, 256)
            step3 = rig.planner.build_step([])
            rig.wt.begin_step(step3)
            rep = rig.poll(set(), "finished_recving")
            assert not rep.failed_recving
            for n in window0:
                got = kv.pages(n, b_tables[[g.name for g in geo.groups].index(n)][4:8])
                assert got == before[n], f"{n}: chunk 0's window is not what A computed"
            assert waited > 1.0, "the step did not wait for the store reading freed blocks"
        finally:
            rig.close()


def test_fence_timeout_aborts_the_store(srv: ServerProcess) -> None:
    """A fence that times out (server stopped longer than ``fence_timeout_s``) drops
    the connection: the store is aborted by the server, never committed from blocks
    the next forward pass rewrote; a later lookup misses rather than serve them."""
    geo = dsv41_flash(num_blocks=96, layers=4)
    with ShmKV(geo) as kv:
        kv.fill_random(8)
        rig = Rig.open(srv.endpoint, geo, kv)
        rig.wt.fence_timeout_s = 0.5
        try:
            tokens = list(range(300, 300 + 600))
            assert rig.matched("A", tokens) == 0
            a = _tables(geo, 1, 600)
            rig.planner.after_alloc("A", a, 0)
            step1 = rig.planner.build_step([ScheduledRequest("A", 0, 512, a, True)])
            rig.wt.begin_step(step1)
            assert srv.proc is not None
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                rig.wt.start_stores(step1.stores)
                step2 = rig.planner.build_step([ScheduledRequest("A", 512, 1, None)])
                assert step2.fence_store_ids
                assert rig.wt.fence(step2.fence_store_ids) is False
                for g in geo.groups:
                    if g.kind == "sliding_window":
                        for li in range(len(g.layers)):
                            for b in a[[x.name for x in geo.groups].index(g.name)][4:8]:
                                kv.page(g.name, li, b)[:] = 0xEE
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            assert rig.tracker.store_futures()[0].exception(20) is not None
            time.sleep(1.0)  # the server, running again, handles what was queued
            with Client(srv.endpoint) as c:
                assert c.stats().counters.stored_objects == 0  # a fresh server
                reg = c.register(**kv.register_kwargs(buffers=[], replicated=True))
                digests = rig.geometry.digests(block_hashes(tokens, rig.per), 1)
                assert c.lookup(reg, digests, lease=False).hit_chunks == 0
            # the link connects anew on its next request
            other = rig.geometry.digests(block_hashes(list(range(5000, 5300)), rig.per), 1)
            ids = rig.geometry.block_ids(_tables(geo, 40, 300), 0, 1)
            assert rig.work.store(other, ids).result(20).ok.all()
            assert rig.work.reconnects == 1
        finally:
            rig.close()


def test_hundred_requests_hit_in_one_step(srv: ServerProcess) -> None:
    """120 requests store in one step and 120 load in one step: one batched
    store and batched retrieves of at most ``LOAD_PART_CHUNKS`` chunks (4), no
    ``busy``, every load succeeds byte-exact."""
    n = 120
    with ShmKV(simple_model(num_blocks=34 * n + 8, layers=2, bytes_per_token=32)) as kv:
        kv.fill_random(3)
        check_batched_step(srv.endpoint, kv, n)


def test_busy_is_retried_not_failed(srv: ServerProcess) -> None:
    """Back-pressure: a link allowed more in flight than the server takes
    (64 per connection) queues and retries ``busy``; every retrieve succeeds."""
    geo = simple_model(num_blocks=64, layers=1, bytes_per_token=32)
    with ShmKV(geo) as kv:
        kv.fill_random(5)
        link = ServerLink(srv.endpoint, timeout_s=20, max_inflight=200)
        try:
            link.register(**kv.register_kwargs(replicated=True))
            geometry = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
            digests = geometry.digests(block_hashes(list(range(300)), 16), 1)
            ids = {"full": np.arange(1, 17, dtype=np.int32)}
            assert link.store(digests, ids).result(20).ok.all()
            futs = [
                link.retrieve(digests, {"full": np.arange(20, 36, dtype=np.int32)})
                for _ in range(200)
            ]
            assert all(f.result(30).ok.all() for f in futs)
        finally:
            link.close()


def test_shutdown_waits_for_stores_in_flight(srv: ServerProcess) -> None:
    """Stores sent just before shutdown complete (bounded wait) before the
    connection closes; with the server stalled past the bound, shutdown returns in
    time and nothing half-written becomes visible."""
    geo = simple_model(num_blocks=64, layers=1, bytes_per_token=32)
    geometry = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    with ShmKV(geo) as kv:
        kv.fill_random(9)
        link = ServerLink(srv.endpoint, timeout_s=20)
        link.register(**kv.register_kwargs(replicated=True))
        tracker = TransferTracker(by_block_ids=True)
        wt = WorkerTransfers(link, tracker)
        tokens = list(range(7000, 7000 + 1024))
        digests = geometry.digests(block_hashes(tokens, 16), 4)
        from lmc_server.integration.plans import StoreSpec

        spec = StoreSpec(
            "S", 0, digests, {"full": np.arange(1, 65, dtype=np.int32) % 64}, store_id=1
        )
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        resume = threading.Timer(1.0, os.kill, (srv.proc.pid, signal.SIGCONT))
        resume.start()
        try:
            wt.start_stores([spec])
            assert wt.drain(10.0) is True
        finally:
            resume.join()
        link.close()
        with Client(srv.endpoint) as c:
            reg = c.register(**kv.register_kwargs(buffers=[], replicated=True))
            assert c.lookup(reg, digests, lease=False).hit_chunks == 4

        # stalled past the bound: shutdown still returns within it, and the server,
        # once running again, serves on (the store completed whole or not at all)
        link = ServerLink(srv.endpoint, timeout_s=20)
        link.register(**kv.register_kwargs(replicated=True))
        wt = WorkerTransfers(link, TransferTracker(by_block_ids=True))
        other = geometry.digests(block_hashes(list(range(9000, 9000 + 1024)), 16), 4)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            wt.start_stores([StoreSpec("T", 0, other, spec.block_ids, store_id=2)])
            t0 = time.monotonic()
            assert wt.drain(0.5) is False
            link.close(unregister_timeout_s=0.5)
            assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        with Client(srv.endpoint) as c:
            reg = c.register(**kv.register_kwargs(buffers=[], replicated=True))
            assert c.lookup(reg, digests, lease=False).hit_chunks == 4


def test_batched_retrieve_reads_every_requests_window(srv: ServerProcess) -> None:
    """One retrieve carries the loads of several DeepSeek-V4.1 requests of different
    lengths: each request's sliding window (the end of its own prefix) is loaded,
    not only the batch's last one (``Retrieve.prefix_ends``)."""
    geo = dsv41_flash(num_blocks=200, layers=4)
    with ShmKV(geo) as kv:
        kv.fill_random(11)
        rig = Rig.open(srv.endpoint, geo, kv)
        try:
            lengths = {"a": 300, "b": 800, "c": 520}
            prompts = {r: [ord(r)] * 5 + list(range(n - 5)) for r, n in lengths.items()}
            src: dict[str, list[list[int]]] = {}
            first = 1
            for rid, toks in prompts.items():
                assert rig.matched(rid, toks) == 0
                src[rid] = _tables(geo, first, len(toks))
                first += 26
                rig.planner.after_alloc(rid, src[rid], 0)
            plan = rig.planner.build_step(
                [ScheduledRequest(r, 0, len(t), src[r], True) for r, t in prompts.items()]
            )
            rig.wt.begin_step(plan)
            rig.wt.start_stores(plan.stores)
            for rid in prompts:
                rig.planner.request_finished(rid)
            rep = rig.poll(set(prompts), "finished_sending", 3)
            rig.planner.transfers_finished([], rep.finished_sending)
            dst: dict[str, list[list[int]]] = {}
            for rid, toks in prompts.items():
                n = rig.matched("h" + rid, toks)
                assert n == (len(toks) - 1) // CHUNK * CHUNK
                dst[rid] = _tables(geo, first, len(toks))
                first += 26
                rig.planner.after_alloc("h" + rid, dst[rid], n)
            plan = rig.planner.build_step([])
            assert len(plan.loads) == 3
            rig.wt.begin_step(plan)
            rep = rig.poll(set(), "finished_recving", 3)
            assert not rep.failed_recving
            for gi, g in enumerate(geo.groups):
                if not g.cached:
                    continue
                for rid, toks in prompts.items():
                    k = (len(toks) - 1) // CHUNK
                    bpc = CHUNK // g.tokens_per_block
                    lo = 0 if g.kind == "full" else k * bpc - 4  # the last window
                    a, b = src[rid][gi][lo : k * bpc], dst[rid][gi][lo : k * bpc]
                    assert kv.pages(g.name, b) == kv.pages(g.name, a), (g.name, rid)
        finally:
            rig.close()
    with Client(srv.endpoint) as c:
        counts = c.stats().counters.requests
    assert counts.get("retrieve:ok") == 1, counts


def test_bad_prefix_ends_refused(srv: ServerProcess) -> None:
    """A batched retrieve whose prefix ends do not ascend to the chunk count is
    refused (nothing copied) and the server serves on."""
    import asyncio

    from lmc_server.client.aio import AsyncClient
    from lmc_server.client.core import ServerError

    geo = simple_model(num_blocks=64, layers=1, bytes_per_token=32)
    geometry = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    digests = geometry.digests(block_hashes(list(range(800)), 16), 3)
    ids = {"full": np.arange(1, 49, dtype=np.int32)}

    async def run() -> list[str]:
        codes = []
        async with await AsyncClient.connect(srv.endpoint) as c:
            reg = await c.register(**kv.register_kwargs(replicated=True))
            for ends in ([2], [0, 3], [2, 2, 3], [3, 2, 3]):
                try:
                    await c.retrieve(reg, digests, ids, prefix_ends=ends)
                except ServerError as e:
                    codes.append(e.code)
            res = await c.retrieve(reg, digests, ids, prefix_ends=[1, 3])
            assert res.n_chunks == 3
        return codes

    with ShmKV(geo) as kv:
        assert asyncio.run(run()) == ["bad_request"] * 4


def test_link_survives_a_server_restart() -> None:
    """A restarted server has forgotten the registration: the link connects and
    registers again and the request succeeds (no request fails for it)."""
    geo = simple_model(num_blocks=64, layers=1, bytes_per_token=32)
    geometry = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    digests = geometry.digests(block_hashes(list(range(600)), 16), 2)
    ids = {"full": np.arange(1, 33, dtype=np.int32)}
    args = ["--chunk-size", "256", "--separate-object-groups"]
    with ShmKV(geo) as kv:
        kv.fill_random(2)
        first = ServerProcess(args, l1_size_gb=0.25).start()
        link = ServerLink(first.endpoint, timeout_s=10)
        try:
            link.register(**kv.register_kwargs(replicated=True))
            assert link.store(digests, ids).result(10).ok.all()
            first.terminate()
            with ServerProcess(args, port=first.port, l1_size_gb=0.25):
                assert link.lookup(digests).result(15).hit_chunks == 0  # a new, empty pool
                assert link.store(digests, ids).result(15).ok.all()
                assert link.lookup(digests).result(10).hit_chunks == 2
                assert link.reconnects == 1
        finally:
            first.kill()
            link.close(unregister_timeout_s=2)


def test_load_time_is_measured_byte_exact(srv: ServerProcess) -> None:
    """The CPU twin of tests/gpu/test_connector_load_time.py: hits of 1 and 4 chunks load
    byte-exact through the connector and the time from the scheduler's decision to
    ``finished_recving`` is measured (the figures come from the GPU run)."""
    from lmc_server.testing.connector_timing import blocks_needed, load_times

    with ShmKV(simple_model(num_blocks=blocks_needed((1, 4)), layers=2)) as kv:
        kv.fill_random(5)
        res = load_times(srv.endpoint, kv, (1, 4), repeats=2)
    assert set(res) == {1, 4}
    assert all(0 < r["median_s"] <= r["max_s"] for r in res.values())


def _link_with_store_kv(endpoint: str, kv: ShmKV, timeout_s: float) -> ServerLink:
    link = ServerLink(endpoint, timeout_s=timeout_s)
    link.register(**kv.register_kwargs(replicated=True))
    return link


def test_store_in_flight_fails_at_once_when_the_server_restarts() -> None:
    """A store goes to a server that hangs (SIGSTOP), is killed 0.5 s later and
    started again 0.5 s after that: the link sees the connection drop, finds a server
    younger than the drop, and fails the store at once (well before ``timeout_s``,
    20 s); the next store succeeds on the new server."""
    geo = simple_model(num_blocks=64, layers=1, bytes_per_token=32)
    geometry = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    digests = geometry.digests(block_hashes(list(range(600)), 16), 2)
    ids = {"full": np.arange(1, 33, dtype=np.int32)}
    args = ["--chunk-size", "256", "--separate-object-groups"]
    with ShmKV(geo) as kv:
        kv.fill_random(3)
        first = ServerProcess(args, l1_size_gb=0.25).start()
        fresh: list[ServerProcess] = []
        link = _link_with_store_kv(first.endpoint, kv, timeout_s=20)
        try:
            assert first.proc is not None
            os.kill(first.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            fut = link.store(digests, ids)
            time.sleep(0.5)
            first.kill()
            time.sleep(0.5)
            fresh.append(ServerProcess(args, port=first.port, l1_size_gb=0.25).start())
            with pytest.raises(ConnectionError):
                fut.result(20)
            assert time.monotonic() - t0 < 10.0
            assert link.restarts_detected == 1
            assert link.store(digests, ids).result(15).ok.all()
            assert link.lookup(digests).result(10).hit_chunks == 2
        finally:
            first.kill()
            link.close(unregister_timeout_s=2)
            for s in fresh:
                s.terminate()


def test_store_to_a_stalled_server_is_not_failed_early() -> None:
    """The server stops for 6 s with a store in flight: zmq's heartbeat (4 s) drops the
    connection, but the server that answers afterwards is the same process (it may
    still run the store), so the store is not failed at the drop: it ends at
    ``timeout_s`` as before, and the link then serves on. Either way the store ends no
    earlier than the server came back, and a timeout no earlier than ``timeout_s``."""
    timeout_s = 9.0
    stall_s = 6.0
    geo = simple_model(num_blocks=64, layers=1, bytes_per_token=32)
    geometry = ChunkGeometry(CHUNK, 16, [EngineGroup("full", 16)])
    digests = geometry.digests(block_hashes(list(range(600)), 16), 2)
    ids = {"full": np.arange(1, 33, dtype=np.int32)}
    with (
        ServerProcess(["--chunk-size", "256", "--separate-object-groups"], l1_size_gb=0.25) as srv,
        ShmKV(geo) as kv,
    ):
        kv.fill_random(4)
        link = _link_with_store_kv(srv.endpoint, kv, timeout_s=timeout_s)
        assert srv.proc is not None
        try:
            os.kill(srv.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            fut = link.store(digests, ids)
            ended: list[float] = []
            fut.add_done_callback(lambda _: ended.append(time.monotonic()))
            time.sleep(stall_s)
            os.kill(srv.proc.pid, signal.SIGCONT)
            done, _ = futures.wait([fut], timeout=15)
            assert done, "the store neither completed nor timed out after the stall"
            took_s = ended[0] - t0
            assert took_s >= stall_s, f"the store ended {took_s:.2f} s into the stall"
            error = fut.exception()
            if error is None:
                assert fut.result().ok.all()  # the connection survived the stall
            else:
                # Dropped by the heartbeat: it may only end by its own timeout.
                assert isinstance(error, TimeoutError), repr(error)
                assert took_s >= timeout_s - 0.01, f"timed out after {took_s:.2f} s"
            assert link.restarts_detected == 0
            assert link.store(digests, ids).result(15).ok.all()
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
            link.close(unregister_timeout_s=2)
