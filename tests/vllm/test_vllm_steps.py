"""What LMCacheMPConnector costs a request in engine steps, under vLLM 0.33's
``Scheduler`` and ``AsyncScheduler`` (``engine_sim``): a miss is scheduled in the step
after it arrives, as without a connector; a hit's prefill waits at most one step for
its load under sync scheduling, two under async (vLLM schedules step N+1 before it
reads step N's output); the scheduler thread waits for lookups at most
``lookup_wait_s`` per step, however many requests wait. Marker ``vllm``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from sim_common import engine, prompt

from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

SCHEDULERS = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
#: bounds generous enough that a loaded test machine answers within them: the tests
#: check what happens while the server answers within the bound
BOUNDS = {"lmcache.mp.lookup_wait_s": 0.1, "lmcache.mp.idle_load_wait_s": 0.1}


def added_steps(e: Any, req_id: str) -> int:
    """Steps between a request's arrival and its first scheduled tokens, beyond the one
    step an engine without a connector takes."""
    return int(e.first_scheduled_step[req_id] - e.added_at_step[req_id] - 1)


@pytest.mark.parametrize("model", ["plain", "dsv41"])
@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_miss_costs_no_step_and_hit_at_most_one_or_two(
    srv: ServerProcess, tmp_model: Path, model: str, async_scheduling: bool
) -> None:
    """One request at a time on an idle engine, 700-token prompts."""
    e = engine(srv, tmp_model, model, extra=BOUNDS, async_scheduling=async_scheduling)
    try:
        a = prompt(70, 700)
        e.add("miss", a, max_tokens=2)
        e.run(["miss"])
        assert added_steps(e, "miss") == 0
        e.forget_local_cache()
        e.add("hit", a + [1], max_tokens=1)
        e.run(["hit"])
        assert e.loaded_tokens.get("hit") == 512
        assert added_steps(e, "hit") <= (2 if async_scheduling else 1)
        assert not e.failed
        e.assert_no_wrong_bytes()
    finally:
        e.close()


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_scheduler_waits_at_most_the_bound_per_step(
    srv: ServerProcess, tmp_model: Path, async_scheduling: bool
) -> None:
    """256 requests wait while the server is stopped: one step's scheduling waits for
    lookups at most ``lookup_wait_s`` in all (0.1 s; one wait per request would be
    25.6 s). Once the server answers, all 256 are served, every byte right."""
    n = 256
    e = engine(
        srv,
        tmp_model,
        "plain",
        extra=BOUNDS,
        num_blocks=n * 50,
        max_num_batched_tokens=8192,
        async_scheduling=async_scheduling,
    )
    assert srv.proc is not None
    try:
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            for i in range(n):
                e.add(f"r{i}", prompt(500 + i, 300), max_tokens=1)
            t0 = time.monotonic()
            out = e.scheduler.schedule()
            took_s = time.monotonic() - t0
            assert out.total_num_scheduled_tokens == 0  # every request asks again
            assert e.connector.planner.lookups_in_flight == n
            assert took_s < 1.5, f"one step's scheduling took {took_s:.2f} s"
            e.steps += 1
            e._update(out, e._execute(out))
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        e.run([f"r{i}" for i in range(n)])
        assert not e.failed and len(e.finished) == n
        e.assert_no_wrong_bytes()
    finally:
        e.close()


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_lookups_of_one_step_go_out_as_one_request(
    srv: ServerProcess, tmp_model: Path, async_scheduling: bool
) -> None:
    """256 requests arrive before one step: their lookups reach the server from one
    hand-over to the link as ``lookup_batch`` requests of 16 chunks, then twice as
    many each up to 128 (256 lookups of 2 chunks: 7 messages, no single lookup),
    every answer is in at its request's first question (no "ask again"), and every
    request is served right."""
    from lmc_server.client import Client

    n = 256
    e = engine(
        srv,
        tmp_model,
        "plain",
        extra=BOUNDS,
        num_blocks=n * 50,
        max_num_batched_tokens=8192,
        async_scheduling=async_scheduling,
    )
    try:
        with Client(srv.endpoint) as c:
            before = c.stats().counters
            for i in range(n):
                e.add(f"b{i}", prompt(2000 + i, 600), max_tokens=1)
            e.run([f"b{i}" for i in range(n)])
            after = c.stats().counters
        sent = {
            k: after.requests.get(k, 0) - before.requests.get(k, 0)
            for k in ("lookup_batch:ok", "lookup:ok")
        }
        assert sent == {"lookup_batch:ok": 7, "lookup:ok": 0}, sent
        assert after.lookups - before.lookups == n
        assert e.connector.planner.lookups_answered_at_once == n
        assert not e.failed and len(e.finished) == n
        e.assert_no_wrong_bytes()
    finally:
        e.close()
