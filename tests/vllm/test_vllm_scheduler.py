"""LMCacheMPConnector under vLLM 0.33's own scheduler, against a real server, with
every page attention reads checked against the token prefix that produced it
(``engine_sim``: scheduler-side connector created by vLLM from ``kv_transfer_config``,
worker-side connector called in the V1 model runner's order). Marker ``vllm``."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sim_common import SERVER_ARGS, engine, prompt

from lmc_server.client import Client
from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

MODELS = ["plain", "dsv41"]


def counters(srv: ServerProcess) -> dict[str, int]:
    with Client(srv.endpoint) as c:
        return dict(c.stats().counters.requests)


@pytest.mark.parametrize("model", MODELS)
def test_shared_prefixes_and_partial_hits(srv: ServerProcess, tmp_model: Path, model: str) -> None:
    e = engine(srv, tmp_model, model)
    try:
        base = prompt(1, 900)
        e.add("a", base, max_tokens=4)
        e.run(["a"])
        e.forget_local_cache()
        # b: the same 900 tokens then more (hit: 3 chunks); c: 600 shared (2 chunks),
        # after vLLM forgot b (else c may find b's blocks in vLLM's own cache, once b's
        # load finished before c's lookup answered)
        e.add("b", base + prompt(2, 300), max_tokens=4)
        e.run(["b"])
        e.forget_local_cache()
        e.add("c", base[:600] + prompt(3, 200), max_tokens=4)
        e.run(["c"])
        assert not e.failed
        assert e.loaded_tokens == {"b": 768, "c": 512}
        # d: vLLM's own cache holds c's blocks now; the server adds nothing beyond
        e.add("d", base[:600] + prompt(3, 200) + prompt(4, 50), max_tokens=2)
        e.run(["d"])
        assert "d" not in e.loaded_tokens and not e.failed
        e.assert_no_wrong_bytes()
    finally:
        e.close()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("budget", [256, 512, 200, 300])
def test_chunked_prefill_on_and_off_chunk_boundaries(
    srv: ServerProcess, tmp_model: Path, model: str, budget: int
) -> None:
    """Step ends on chunk boundaries (budget 256, 512) and off them (200, 300): every
    chunk is stored once complete, and a later hit loads exactly what was computed."""
    e = engine(srv, tmp_model, model, max_num_batched_tokens=budget, num_blocks=400)
    try:
        p1, p2 = prompt(10 + budget, 1100), prompt(20 + budget, 700)
        e.add("x", p1, max_tokens=3)
        e.add("y", p2, max_tokens=3)
        e.run(["x", "y"])
        e.forget_local_cache()
        e.add("x2", p1 + [5], max_tokens=2)
        e.add("y2", p2[:600], max_tokens=2)
        e.run(["x2", "y2"])
        assert not e.failed
        assert e.loaded_tokens == {"x2": 1024, "y2": 512}
        e.assert_no_wrong_bytes()
    finally:
        e.close()


@pytest.mark.parametrize("model", MODELS)
def test_hundred_requests_hit_in_one_step(srv: ServerProcess, tmp_model: Path, model: str) -> None:
    """120 requests hit (100+ of them in one step: their lookups all answered after the
    step that sent them) under ``kv_load_failure_policy=fail``: a step's loads in
    batched retrieves of at most ``LOAD_PART_CHUNKS`` chunks (not one per request), no
    ``busy``, none fails, every loaded byte right."""
    from lmc_server.integration.link.batches import LOAD_PART_CHUNKS

    n = 120
    e = engine(
        srv, tmp_model, model, num_blocks=n * 30, max_num_batched_tokens=8192, max_num_seqs=256
    )
    try:
        prompts = {f"r{i}": prompt(100 + i, 300) for i in range(n)}
        for rid, p in prompts.items():
            e.add(rid, p, max_tokens=1)
        e.run(prompts)
        e.forget_local_cache()
        before = counters(srv)
        for rid, p in prompts.items():
            e.add("h" + rid, p + [7, 8], max_tokens=1)
        # the server held while the step sends every lookup: the link's first parts
        # are small, so some answers could otherwise come within this step's wait and
        # admit their requests a step before the rest
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            e.step()
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        e.wait_lookups()
        e.run(["h" + r for r in prompts])
        after = counters(srv)
        assert not e.failed
        assert {r: e.loaded_tokens.get("h" + r) for r in prompts} == dict.fromkeys(prompts, 256)
        # vLLM admits the hits as their lookups answer: nearly all in one step
        assert e.max_loads_per_step >= 100
        retrieves = after.get("retrieve:ok", 0) - before.get("retrieve:ok", 0)
        # loads of one chunk: the largest step's in parts, at most one per other step
        parts = -(-e.max_loads_per_step // LOAD_PART_CHUNKS)
        assert retrieves <= parts + n - e.max_loads_per_step
        assert not any(k.endswith(":busy") for k in after), after
        e.assert_no_wrong_bytes()
    finally:
        e.close()


@pytest.mark.parametrize("model", MODELS)
def test_eviction_between_lookup_and_load(srv: ServerProcess, tmp_model: Path, model: str) -> None:
    """The server is told to evict everything after the lookups answered and before
    the loads run: the leases keep the hit chunks, the loads succeed byte-exact."""
    e = engine(srv, tmp_model, model)
    try:
        p = prompt(3, 800)
        e.add("a", p, max_tokens=2)
        e.run(["a"])
        e.forget_local_cache()
        cleared: list[int] = []

        def clear(out: Any) -> None:
            if out.kv_connector_metadata.plan.loads and not cleared:
                with Client(srv.endpoint) as c:
                    cleared.append(c.clear())

        e.before_worker = clear
        e.add("b", p + [1], max_tokens=2)
        e.run(["b"])
        assert cleared and e.loaded_tokens == {"b": 768} and not e.failed
        e.assert_no_wrong_bytes()
    finally:
        e.close()


@pytest.mark.parametrize(
    ("model", "async_scheduling"), [("plain", False), ("dsv41", False), ("plain", True)]
)
def test_preemption_and_resume(
    srv: ServerProcess, tmp_model: Path, model: str, async_scheduling: bool
) -> None:
    """Too few blocks for every request's decode: vLLM preempts and resumes requests
    (fences their stores first); every byte read stays right, later hits load right.
    With async scheduling (vLLM's AsyncScheduler, step N+1 scheduled and run before
    step N's output is processed) preempted in-flight output is kept, as
    ``requires_kv_delivery = False`` asks. (No block count tried provoked a
    preemption of the DeepSeek-V4.1 engine under async scheduling.)"""
    e = engine(
        srv,
        tmp_model,
        model,
        num_blocks=90 if model == "plain" else 64,
        max_num_batched_tokens=512,
        async_scheduling=async_scheduling,
    )
    try:
        # eight requests: with six, DeepSeek-V4.1's pool sometimes fit them all when a
        # loaded machine delayed the asynchronous loads (no preemption, test not run)
        prompts = {f"p{i}": prompt(200 + i, 260 + 40 * i) for i in range(8)}
        for rid, p in prompts.items():
            e.add(rid, p, max_tokens=200)
        assert (type(e.scheduler).__name__ == "AsyncScheduler") == async_scheduling
        e.run(prompts, max_steps=4000)
        assert e.preempted, "the test did not cause a preemption"
        e.forget_local_cache()
        for rid, p in prompts.items():
            e.add("h" + rid, p + [9], max_tokens=1)
        e.run(["h" + r for r in prompts], max_steps=4000)
        assert not e.failed
        assert all(e.loaded_tokens.get("h" + r, 0) >= 256 for r in prompts), e.loaded_tokens
        e.assert_no_wrong_bytes()
    finally:
        e.close()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stalled_server(
    srv: ServerProcess, tmp_model: Path, model: str, async_scheduling: bool
) -> None:
    """The server stops (SIGSTOP) for 3 s while requests prefill in chunks and decode
    over a small block pool (vLLM reuses freed sliding-window blocks within a step or
    two). Steps wait where a store reads reusable blocks; nothing served later is
    stale, and no request fails."""
    e = engine(
        srv,
        tmp_model,
        model,
        num_blocks=120,
        max_num_batched_tokens=512,
        async_scheduling=async_scheduling,
    )
    try:
        prompts = {f"s{i}": prompt(300 + i, 520 + 130 * i) for i in range(5)}
        for rid, p in prompts.items():
            e.add(rid, p, max_tokens=40)
        proc = srv.proc
        assert proc is not None
        stopped = threading.Event()

        def stall(out: Any) -> None:
            if e.steps == 2 and not stopped.is_set():
                stopped.set()
                os.kill(proc.pid, signal.SIGSTOP)
                threading.Timer(3.0, os.kill, (proc.pid, signal.SIGCONT)).start()

        e.before_worker = stall
        t0 = time.monotonic()
        e.run(prompts, max_steps=4000)
        assert stopped.is_set() and time.monotonic() - t0 > 2.5
        e.before_worker = None
        e.forget_local_cache()
        for rid, p in prompts.items():
            e.add("h" + rid, p[: 512 + 1], max_tokens=1)
        e.run(["h" + r for r in prompts])
        assert not e.failed
        assert all(e.loaded_tokens.get("h" + r) == 512 for r in prompts), e.loaded_tokens
        e.assert_no_wrong_bytes()
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT) if srv.proc else None
        e.close()


@pytest.mark.parametrize("model", MODELS)
def test_restarted_server(srv: ServerProcess, tmp_model: Path, model: str) -> None:
    """The server restarts (empty) while vLLM keeps its own prefix cache: the
    connector reconnects, and chunks vLLM holds but the server lost are stored again
    (a later hit loads them from the new server)."""
    e = engine(srv, tmp_model, model, load_failure_policy="recompute")
    try:
        p = prompt(5, 1000)
        e.add("a", p, max_tokens=2)
        e.run(["a"])
        srv.terminate()
        with ServerProcess(SERVER_ARGS, port=srv.port, l1_size_gb=0.5) as fresh:
            # b: vLLM's own cache holds a's 1000 tokens, the new server nothing; b
            # computes 300 more. Its store must include the chunks vLLM held.
            q = prompt(6, 300)
            e.add("b", p + q, max_tokens=2)
            e.run(["b"])
            assert "b" not in e.loaded_tokens
            e.forget_local_cache()
            e.add("c", p + q + [4], max_tokens=1)
            e.run(["c"])
            assert e.loaded_tokens == {"c": 1280} and not e.failed
            e.assert_no_wrong_bytes()
            assert counters(fresh).get("store:ok", 0) >= 1
            e.close()
    finally:
        srv.proc = None


@pytest.mark.parametrize("store_generated", [True, False])
def test_next_turn_hits_the_generated_answer(
    srv: ServerProcess, tmp_model: Path, store_generated: bool
) -> None:
    """Whole chunks of generated tokens are stored (on by default): the next turn,
    whose prompt holds the answer, hits past the first turn's prompt."""
    e = engine(srv, tmp_model, "dsv41", extra={"lmcache.mp.store_generated": store_generated})
    try:
        turn1 = prompt(6, 300)
        e.add("t1", turn1, max_tokens=300)
        e.run(["t1"])
        e.forget_local_cache()
        convo = list(e.requests["t1"].all_token_ids)
        assert len(convo) == 600
        e.add("t2", convo + prompt(7, 40), max_tokens=1)
        e.run(["t2"])
        assert e.loaded_tokens == {"t2": 512 if store_generated else 256}
        assert not e.failed
        e.assert_no_wrong_bytes()
    finally:
        e.close()


def test_connector_decisions_against_vllm(srv: ServerProcess, tmp_model: Path) -> None:
    """vLLM 0.33's base class: ``requires_kv_delivery`` defaults to True for
    ``kv_both``; this connector is a best-effort cache and says False (preempted
    output is kept; its stores are fenced before the blocks are reused)."""
    e = engine(srv, tmp_model, "plain")
    try:
        assert e.connector.requires_kv_delivery is False
        assert e.scheduler.requires_kv_delivery is False
    finally:
        e.close()


def test_sm100_compressed_group_of_128_token_blocks(srv: ServerProcess, tmp_model: Path) -> None:
    """On SM100 vLLM prefers 128-token blocks for the compressed group: the 256-token
    chunk rule holds (a multiple of 128 and of the 32-token windows) and hits load
    byte-exact."""
    e = engine(srv, tmp_model, "dsv41", arch="sm100", compressed_block=128)
    try:
        sizes = {g.kv_cache_spec.block_size for g in e.cfg.kv_cache_groups}
        assert 128 in sizes
        p = prompt(8, 700)
        e.add("a", p, max_tokens=2)
        e.run(["a"])
        e.forget_local_cache()
        e.add("b", p + [1], max_tokens=1)
        e.run(["b"])
        assert e.loaded_tokens == {"b": 512} and not e.failed
        e.assert_no_wrong_bytes()
    finally:
        e.close()
