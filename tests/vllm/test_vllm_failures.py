"""LMCacheMPConnector under vLLM 0.33's ``Scheduler`` and ``AsyncScheduler`` when
something fails: a load that fails on a sliding-window model, a server that dies with a
store in flight, a request aborted while its lookup is out. Each ends with the byte
oracle of ``engine_sim`` (every page attention reads is what its token prefix would
hold) and a server that still serves. Marker ``vllm``."""

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

SCHEDULERS = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def leases(endpoint: str) -> int:
    with Client(endpoint) as c:
        return int(c.stats().leases)


def restarted(srv: ServerProcess) -> ServerProcess:
    """A fresh (empty) server on ``srv``'s port."""
    return ServerProcess(SERVER_ARGS, port=srv.port, l1_size_gb=0.5).start()


@pytest.mark.parametrize("model", ["swa", "dsv41"])
@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_failed_load_never_reads_a_window_it_does_not_hold(
    srv: ServerProcess, tmp_model: Path, model: str, async_scheduling: bool
) -> None:
    """Window 128: A stores 700 tokens; vLLM's prefix cache is reset; B (600 shared
    tokens + 200) hits 2 chunks, so vLLM gives B blocks only for the window at the
    hit's end (the table's earlier entries are the null block). The server restarts
    (empty) after the lookup and before the load: the load fails. Under
    ``recompute`` vLLM must not resume B at a position whose window it never held
    (single group: truncated at the first failed block, 384, it would read [257, 384)
    from null blocks); B is recomputed and every byte attention reads is right."""
    e = engine(
        srv, tmp_model, model, load_failure_policy="recompute", async_scheduling=async_scheduling
    )
    fresh: list[ServerProcess] = []
    try:
        a = prompt(40, 700)
        e.add("a", a, max_tokens=2)
        e.run(["a"])
        e.forget_local_cache()

        def restart(out: Any) -> None:
            if out.kv_connector_metadata.plan.loads and not fresh:
                srv.terminate()
                fresh.append(restarted(srv))

        e.before_worker = restart
        e.add("b", a[:600] + prompt(41, 200), max_tokens=2)
        e.run(["b"])
        assert fresh, "no load was planned"
        assert "b" in e.finished and not e.failed
        e.assert_no_wrong_bytes()
        # the restarted server serves: B's chunks were stored again, C hits them
        e.before_worker = None
        e.forget_local_cache()
        e.add("c", a[:600] + prompt(41, 200) + [3], max_tokens=1)
        e.run(["c"])
        assert e.loaded_tokens.get("c") == 768 and not e.failed
        e.assert_no_wrong_bytes()
    finally:
        e.close()
        for s in fresh:
            s.terminate()
        srv.proc = None


@pytest.mark.parametrize("model", ["swa", "dsv41"])
@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_server_killed_with_a_store_in_flight_does_not_stall_the_engine(
    srv: ServerProcess, tmp_model: Path, model: str, async_scheduling: bool
) -> None:
    """Default ``timeout_s`` (30 s): the first step's store goes to a server that
    hangs (SIGSTOP), is killed 0.5 s later and started again 0.5 s after that. A later
    step fences that store (sliding-window blocks it reads leave the window). The
    lost connection fails the store at once, so the fence, and every request of the
    engine, waits about the restart time, not ``timeout_s``; the engine then stores
    on and hits on the new server."""
    e = engine(
        srv, tmp_model, model, extra={"lmcache.mp.timeout_s": 30}, async_scheduling=async_scheduling
    )
    fresh: list[ServerProcess] = []
    crash_done = threading.Event()
    try:
        assert srv.proc is not None
        pid = srv.proc.pid

        def crash_and_restart() -> None:
            try:
                time.sleep(0.5)
                srv.kill()
                time.sleep(0.5)
                fresh.append(restarted(srv))
            finally:
                crash_done.set()

        started: list[float] = []

        def stall(out: Any) -> None:
            if out.kv_connector_metadata.plan.stores and not started:
                started.append(time.monotonic())
                os.kill(pid, signal.SIGSTOP)
                threading.Thread(target=crash_and_restart, daemon=True).start()

        e.before_worker = stall
        t0 = time.monotonic()
        e.add("a", prompt(60, 700), max_tokens=8)
        e.run(["a"])
        elapsed_s = time.monotonic() - t0
        assert started and crash_done.wait(20) and fresh
        assert "a" in e.finished and not e.failed
        # the fence ended with the lost connection, not at timeout_s (30 s)
        assert elapsed_s < 15.0, f"the engine stood still {elapsed_s:.1f} s"
        e.before_worker = None
        b = prompt(61, 700)
        e.add("b", b, max_tokens=2)
        e.run(["b"])
        e.forget_local_cache()
        e.add("b2", b + [5], max_tokens=1)
        e.run(["b2"])
        assert e.loaded_tokens.get("b2") == 512 and not e.failed
        e.assert_no_wrong_bytes()
    finally:
        if started:
            crash_done.wait(30)
        e.close()
        for s in fresh:
            s.terminate()


@pytest.mark.parametrize("async_scheduling", SCHEDULERS)
def test_aborted_request_returns_its_lease_while_the_engine_is_idle(
    srv: ServerProcess, tmp_model: Path, async_scheduling: bool
) -> None:
    """A lookup goes out while the server is stopped; the request is aborted; the
    server answers with a lease; the engine then has nothing to do and takes no step
    (as ``EngineCore`` when idle). The lease goes back at once, not at the TTL; the
    server then serves the next request's hit."""
    e = engine(srv, tmp_model, "plain", async_scheduling=async_scheduling)
    try:
        from vllm.v1.request import RequestStatus

        p = prompt(50, 700)
        e.add("a", p, max_tokens=1)
        e.run(["a"])
        e.forget_local_cache()
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            e.add("b", p + [1], max_tokens=1)
            e.step()  # the lookup goes out; no answer yet
            assert e.connector.planner.lookups_in_flight == 1
            e.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5.0  # the lease TTL is 30 s
        while leases(srv.endpoint) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leases(srv.endpoint) == 0
        e.add("c", p + [2], max_tokens=1)
        e.run(["c"])
        assert e.loaded_tokens.get("c") == 512 and not e.failed
        e.assert_no_wrong_bytes()
    finally:
        e.close()
