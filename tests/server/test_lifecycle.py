"""Lifecycle: the drain at shutdown, health states, SIGTERM, SIGHUP, log formats.

Contract: a shutdown (SIGTERM) stops new work, lets in-flight copies finish within the
drain timeout, answers every request it received (a result, or a ``shutting_down``
error for a store cut off by the timeout), and exits 0. SIGHUP reopens the log file.

The drain and the health states run in process (:mod:`lmc_server.testing.inprocess`):
copies are held in the engine until the test releases them
(:class:`~lmc_server.testing.engines.HoldingEngine`) and time is a fake clock, so each
state is reached by the test, not by racing a copy's duration. Signals, log files and
the command line need a process and get one.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, ServerError
from lmc_server.client.core import ChunkResult, Registration
from lmc_server.client.digests import chunk_digests
from lmc_server.config import Config
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import encode
from lmc_server.server.liveness import HEALTH_STALL_S
from lmc_server.server.notify import Notifier
from lmc_server.server.server import Server
from lmc_server.testing.engines import BackloggedEngine, HoldingEngine
from lmc_server.testing.inprocess import FakeClock, ThreadServer, run_server
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.poll import wait_for
from lmc_server.testing.presets import simple_model
from lmc_server.testing.process import ServerProcess, free_port, wait_pool_ready
from lmc_server.testing.systemd import FakeSystemd

CHUNK = 256
N_CHUNKS = 32  # 32 chunks x 8 layers x 256 tokens x 16 KiB: a 1 GiB store, L1 full


@pytest.fixture(scope="module")
def big_kv() -> Iterator[ShmKV]:
    geo = simple_model(num_blocks=512, layers=8, tokens_per_block=16, bytes_per_token=16384)
    with ShmKV(geo) as kv:
        kv.fill(7)  # contents do not matter here, and random bytes take seconds
        yield kv


def sample(port: int, prefix: str) -> int:
    """The value of the first /metrics line starting with ``prefix``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in body.splitlines():
        if line.startswith(prefix):
            return int(float(line.split()[-1]))
    raise AssertionError(f"{prefix} missing from /metrics")


def in_flight(port: int) -> int:
    return sample(port, "lmcache_requests_in_flight ")


def wait_pool_prepared(port: int, timeout_s: float = 30.0) -> None:
    pending = 'lmcache_l1_slabs{state="pending"}'
    wait_for(lambda: sample(port, pending) == 0, "L1 pool prepared", timeout_s, poll_s=0.02)


def sigterm_during_store(
    kv: ShmKV, drain_timeout_s: float
) -> tuple[ServerProcess, ChunkResult | ServerError]:
    """Start a 1 GiB store and SIGTERM the server process while it copies."""
    port = free_port()
    srv = ServerProcess(
        ["--chunk-size", str(CHUNK), "--drain-timeout-s", str(drain_timeout_s)],
        l1_size_gb=1,
        metrics_port=port,
    ).start()
    outcome: list[ChunkResult | ServerError] = []
    try:
        wait_pool_prepared(port)
        with Client(srv.endpoint, timeout_s=60) as c:
            reg: Registration = c.register(**kv.register_kwargs())
            digests = chunk_digests(np.arange(N_CHUNKS * CHUNK), CHUNK)
            ids = block_ids_for(reg, N_CHUNKS)

            def run() -> None:
                try:
                    outcome.append(c.store(reg, digests, ids))
                except ServerError as e:
                    outcome.append(e)

            worker = threading.Thread(target=run)
            worker.start()
            deadline = time.monotonic() + 10
            while in_flight(port) == 0:
                assert worker.is_alive(), "the store finished before it was seen in flight"
                assert time.monotonic() < deadline
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGTERM)
            worker.join(60)
            assert not worker.is_alive(), "no reply to the in-flight store"
        # it exits by itself; a second SIGTERM (terminate()) could arrive after it
        # restored the default handler and kill it (-15)
        assert srv.proc.wait(60) == 0, srv.log()
    finally:
        srv.kill()
    return srv, outcome[0]


def test_sigterm_lets_an_in_flight_store_finish(big_kv: ShmKV) -> None:
    """The signal end to end, in a process: SIGTERM drains, then exits 0."""
    srv, result = sigterm_during_store(big_kv, drain_timeout_s=30)
    assert isinstance(result, ChunkResult), result
    assert result.ok.all()
    log = srv.log()
    assert "draining 1 in-flight requests" in log
    assert "shutdown complete" in log


# -- the drain, in process: copies held by the engine until the test releases them ------


def wire_ids(reg: Registration, ids: dict[str, np.ndarray]) -> list[bytes]:
    """Block ids as a store or retrieve carries them (int32 LE per group)."""
    return [ids[g.name].astype("<i4").tobytes() if g.cached else b"" for g in reg.groups]


def send_store(
    c: Client, reg: Registration, req_id: int, digests: bytes, ids: dict[str, np.ndarray]
) -> None:
    c.send_raw(
        [
            encode(
                m.Store(
                    req_id=req_id,
                    registration_id=reg.registration_id,
                    digests=digests,
                    block_ids=wire_ids(reg, ids),
                )
            )
        ]
    )


def send_retrieve(
    c: Client, reg: Registration, req_id: int, digests: bytes, ids: dict[str, np.ndarray]
) -> None:
    c.send_raw(
        [
            encode(
                m.Retrieve(
                    req_id=req_id,
                    registration_id=reg.registration_id,
                    digests=digests,
                    block_ids=wire_ids(reg, ids),
                )
            )
        ]
    )


def shutdown_started(ts: ThreadServer) -> threading.Event:
    """Set when the server begins its drain (its ``on_shutdown`` callbacks run)."""
    began = threading.Event()
    ts.server.on_shutdown.append(lambda _server: began.set())
    return began


def test_drain_lets_an_in_flight_store_finish_and_refuses_new_work() -> None:
    engine = HoldingEngine()
    with (
        ShmKV(simple_model()) as kv,
        run_server(engine=engine, drain_timeout_s=30) as ts,
        Client(ts.endpoint) as c,
    ):
        kv.fill_random(5)
        reg = c.register(**kv.register_kwargs())
        digests = chunk_digests(np.arange(4 * CHUNK), CHUNK)
        try:
            send_store(c, reg, 100, digests, block_ids_for(reg, 4))
            engine.wait_held()  # in flight: its copy is in the engine
            began = shutdown_started(ts)
            ts.request_exit()
            assert began.wait(10)
            assert ts.server.health() == (
                False,
                "draining: shutting down, new requests are refused",
            )
            c.send_raw([encode(m.Ping(req_id=101))])  # new work while the copy is held
            reply = c.recv_reply(10)
            assert isinstance(reply, m.Error) and reply.req_id == 101, reply
            assert reply.code == "shutting_down"
        finally:
            assert engine.release() == 1
        reply = c.recv_reply(10)
        assert isinstance(reply, m.StoreResult) and reply.req_id == 100, reply
        assert all(set(s) == {ChunkStatus.OK} for s in reply.statuses), reply.statuses
        ts.stop()
        assert ts.exit_code == 0


def test_past_the_drain_timeout_stores_are_answered_at_once_retrieves_when_copied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store still copying at the timeout is answered ``shutting_down`` while its copy
    is still held (nothing of it is ever served); a retrieve writes into engine memory,
    so it is answered only when its copy has stopped, with its real result."""
    engine = HoldingEngine(holding=False)
    with (
        ShmKV(simple_model()) as kv,
        run_server(engine=engine, drain_timeout_s=0) as ts,
        Client(ts.endpoint) as c,
    ):
        kv.fill_random(6)
        reg = c.register(**kv.register_kwargs())
        stored = chunk_digests(np.arange(CHUNK), CHUNK)  # one chunk: blocks 0..15
        assert c.store(reg, stored, block_ids_for(reg, 1)).ok.all()
        engine.hold()
        try:
            send_store(
                c,
                reg,
                200,
                chunk_digests(np.arange(CHUNK) + 7, CHUNK),
                block_ids_for(reg, 1, first_block=32),
            )
            send_retrieve(c, reg, 201, stored, block_ids_for(reg, 1, first_block=16))
            engine.wait_held(2)
            ts.request_exit()
            reply = c.recv_reply(10)  # with both copies still held
            assert isinstance(reply, m.Error) and reply.req_id == 200, reply
            assert reply.code == "shutting_down" and "nothing was stored" in reply.message
            # anything the server sent at the timeout precedes its answer to this ping
            c.send_raw([encode(m.Ping(req_id=202))])
            reply = c.recv_reply(10)
            assert isinstance(reply, m.Error) and reply.req_id == 202, reply
        finally:
            assert engine.release() == 2
        reply = c.recv_reply(10)
        assert isinstance(reply, m.RetrieveResult) and reply.req_id == 201, reply
        assert all(set(s) == {ChunkStatus.OK} for s in reply.statuses), reply.statuses
        assert kv.pages("full", list(range(16))) == kv.pages("full", list(range(16, 32)))
    assert "drain timeout: 1 stores answered shutting_down, waiting for 1 retrieves" in caplog.text


def test_past_the_drain_timeout_only_copies_are_waited_for() -> None:
    """A store whose chunk another store is writing waits for that
    writer to settle (``server/settle.py``, up to 10 s); past the drain timeout it stops
    waiting, so the drain waits for running copies only, never for the drain timeout
    plus the settle timeout. Here the writer's copy is held: the waiting store's task
    ends at the timeout while the copy is still held."""
    engine = HoldingEngine()
    with (
        ShmKV(simple_model()) as kv,
        run_server(engine=engine, drain_timeout_s=0) as ts,
        Client(ts.endpoint) as writer,
        Client(ts.endpoint) as waiter,
    ):
        kv.fill_random(7)
        reg_w = writer.register(**kv.register_kwargs())
        reg_b = waiter.register(**kv.register_kwargs())  # same namespace, same keys
        ts.server.handlers.commits.timeout_s = 60.0  # longer than this test waits below
        digests = chunk_digests(np.arange(CHUNK), CHUNK)
        try:
            send_store(writer, reg_w, 300, digests, block_ids_for(reg_w, 1))
            engine.wait_held()  # its key is WRITING, its copy held
            send_store(waiter, reg_b, 301, digests, block_ids_for(reg_b, 1))
            waiter.send_raw([encode(m.Ping(req_id=302))])
            reply = waiter.recv_reply(10)  # handled after the store: that one is waiting
            assert isinstance(reply, m.Pong) and reply.req_id == 302, reply
            assert len(ts.server.dispatch.tasks) == 2
            ts.request_exit()
            for c, req_id in ((writer, 300), (waiter, 301)):
                reply = c.recv_reply(10)
                assert isinstance(reply, m.Error) and reply.req_id == req_id, reply
                assert reply.code == "shutting_down"
            deadline = time.monotonic() + 10
            while len(ts.server.dispatch.tasks) > 1:  # the waiting store's task ends
                assert time.monotonic() < deadline, "a store still waits past the timeout"
                time.sleep(0.01)
            assert engine.submissions == 1  # the copy is still held
        finally:
            assert engine.release() == 1
        ts.stop()
        assert ts.exit_code == 0


def test_past_the_drain_timeout_queued_copies_are_not_started(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Copies queued in the engine behind others (a loaded server) are
    not started once the drain timed out, so the drain ends with the copies already
    running instead of the whole backlog: the store waiting for a copy thread is
    answered ``shutting_down`` and its copy never runs (nothing of it is committed)."""
    engine = BackloggedEngine()
    with (
        ShmKV(simple_model()) as kv,
        run_server(engine=engine, drain_timeout_s=0) as ts,
        Client(ts.endpoint) as c,
    ):
        kv.fill_random(8)
        reg = c.register(**kv.register_kwargs())
        try:  # two chunks: 2 MiB, more than is copied inline on the loop
            send_store(
                c, reg, 400, chunk_digests(np.arange(2 * CHUNK), CHUNK), block_ids_for(reg, 2)
            )
            engine.wait_submitted()  # queued behind the busy copy thread
            ts.request_exit()
            reply = c.recv_reply(10)
            assert isinstance(reply, m.Error) and reply.req_id == 400, reply
            assert reply.code == "shutting_down"
        finally:
            engine.release()
        ts.stop()
        assert ts.exit_code == 0
        counters = ts.server.index.stats
        assert counters.stored_objects == 0, "the queued copy ran and was committed"
    assert "copy not started: the server is shutting down" in caplog.text


# -- health and systemd, in process -------------------------------------------------------


def test_health_follows_the_server_state() -> None:
    """Starting, serving, a stuck event loop (by the server's clock: no real waiting),
    serving again once it beats, draining."""
    assert Server(Config(), notifier=Notifier(None)).health() == (
        False,
        "starting: sockets not bound yet",
    )
    clock = FakeClock()
    with (
        FakeSystemd() as systemd,
        run_server(
            clock=clock, notifier=systemd.notifier(watchdog_interval_s=0.01), backend="null"
        ) as ts,
    ):
        wait_pool_ready(ts.endpoint, 30)
        serving, reason = ts.server.health()
        assert serving and reason.startswith(f"serving on {ts.endpoint}"), reason
        stuck, unstick = threading.Event(), threading.Event()

        def block_the_loop() -> None:
            stuck.set()
            unstick.wait(30)

        ts.call_soon(block_the_loop)
        try:
            assert stuck.wait(10)
            clock.advance(HEALTH_STALL_S - 1)
            assert ts.server.health()[0]
            clock.advance(2)
            assert ts.server.health() == (False, "event loop unresponsive for 11 s")
            beats = systemd.count("WATCHDOG=1")
        finally:
            unstick.set()
        systemd.wait_count("WATCHDOG=1", beats + 2)  # beating again
        assert ts.server.health()[0]
        began = shutdown_started(ts)
        ts.request_exit()
        assert began.wait(10)
        assert not ts.server.health()[0]


def test_an_embedded_server_ignores_the_notify_socket_of_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run_server`` gives the server its own notifier: a test run under systemd (with
    ``NOTIFY_SOCKET`` set) must not tell that systemd it is ready or stopping. A server
    built without a notifier does read ``NOTIFY_SOCKET``."""
    with FakeSystemd() as systemd:
        monkeypatch.setenv("NOTIFY_SOCKET", systemd.env_value)
        assert Server(Config()).notifier.address == systemd.env_value
        with run_server(backend="null") as ts, Client(ts.endpoint) as c:
            c.ping()
        systemd.close()  # reads what is queued: every datagram the server sent
        assert systemd.assignments() == []


def test_sighup_reopens_the_log_file(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    with ServerProcess(["--log-file", str(path)]) as srv:
        rotated = tmp_path / "server.log.1"
        path.rename(rotated)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not (path.exists() and "SIGHUP: reopened" in path.read_text()):
            assert time.monotonic() < deadline, "log file not reopened after SIGHUP"
            time.sleep(0.02)
        with Client(srv.endpoint) as c:
            c.ping()
    assert "starting:" in rotated.read_text()
    assert "SIGHUP" not in rotated.read_text()
    assert "shutdown complete" in path.read_text()
    assert srv.log() == ""  # nothing went to stderr


def test_json_log_lines(tmp_path: Path) -> None:
    with ServerProcess(["--log-format", "json"]) as srv:
        with Client(srv.endpoint) as c:
            c.ping()
    lines = [json.loads(line) for line in srv.log().splitlines() if line.strip()]
    assert lines and all({"time", "level", "logger", "message"} <= set(r) for r in lines)
    assert "chunk_size=256" in lines[0]["message"]  # the effective config, first
    assert lines[-1]["message"] == "shutdown complete"


def test_unwritable_log_file_is_a_usage_error(tmp_path: Path) -> None:
    srv = ServerProcess(["--log-file", str(tmp_path / "missing" / "x.log")])
    with pytest.raises(RuntimeError, match="exited with status 2"):
        srv.start()
    assert "directory does not exist" in srv.log()
