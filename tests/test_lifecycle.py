"""Lifecycle of a real server process: SIGTERM with copies in flight, SIGHUP, log formats.

Contract: SIGTERM stops new work, lets in-flight copies finish within the drain
timeout, answers every request it received (a result, or a ``shutting_down`` error for
a store cut off by the timeout), and exits 0. SIGHUP reopens the log file.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server.client import Client, ServerError
from lmc_server.client.core import ChunkResult, Registration
from lmc_server.client.digests import chunk_digests
from lmc_server.config import Config
from lmc_server.server.notify import Notifier
from lmc_server.server.server import Server
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.presets import simple_model
from lmc_server.testing.process import ServerProcess, free_port

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
    deadline = time.monotonic() + timeout_s
    while sample(port, 'lmcache_l1_slabs{state="pending"}') > 0:
        assert time.monotonic() < deadline, "L1 pool not prepared in time"
        time.sleep(0.02)


def sigterm_during_store(kv: ShmKV, drain_timeout_s: float,
                         op: str = "store") -> tuple[ServerProcess, ChunkResult | ServerError]:
    """Start a 1 GiB store (or retrieve) and SIGTERM the server while it copies."""
    port = free_port()
    srv = ServerProcess(["--chunk-size", str(CHUNK), "--drain-timeout-s", str(drain_timeout_s)],
                        l1_size_gb=1, metrics_port=port).start()
    outcome: list[ChunkResult | ServerError] = []
    try:
        wait_pool_prepared(port)
        with Client(srv.endpoint, timeout_s=60) as c:
            reg: Registration = c.register(**kv.register_kwargs())
            digests = chunk_digests(np.arange(N_CHUNKS * CHUNK), CHUNK)
            ids = block_ids_for(reg, N_CHUNKS)
            if op == "retrieve":
                assert c.store(reg, digests, ids).ok.all()

            def run() -> None:
                try:
                    outcome.append(getattr(c, op)(reg, digests, ids))
                except ServerError as e:
                    outcome.append(e)

            worker = threading.Thread(target=run)
            worker.start()
            deadline = time.monotonic() + 10
            while in_flight(port) == 0:
                assert worker.is_alive(), f"the {op} finished before it was seen in flight"
                assert time.monotonic() < deadline
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGTERM)
            worker.join(60)
            assert not worker.is_alive(), f"no reply to the in-flight {op}"
        assert srv.terminate(timeout_s=60) == 0, srv.log()
    finally:
        srv.kill()
    return srv, outcome[0]


def test_sigterm_lets_an_in_flight_store_finish(big_kv: ShmKV) -> None:
    srv, result = sigterm_during_store(big_kv, drain_timeout_s=30)
    assert isinstance(result, ChunkResult), result
    assert result.ok.all()
    log = srv.log()
    assert "draining 1 in-flight requests" in log
    assert "shutdown complete" in log


def test_sigterm_past_the_drain_timeout_answers_the_store_with_an_error(
        big_kv: ShmKV) -> None:
    srv, result = sigterm_during_store(big_kv, drain_timeout_s=0)
    assert isinstance(result, ServerError), result
    assert result.code == "shutting_down" and "nothing was stored" in str(result)
    assert "1 stores answered shutting_down" in srv.log()


def test_sigterm_past_the_drain_timeout_waits_for_a_retrieve(big_kv: ShmKV) -> None:
    """A retrieve writes into engine memory: it is answered when its copy has stopped."""
    srv, result = sigterm_during_store(big_kv, drain_timeout_s=0, op="retrieve")
    assert isinstance(result, ChunkResult), result
    assert result.ok.all()
    assert "waiting for 1 retrieves" in srv.log()


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


def test_health_states_in_process() -> None:
    server = Server(Config(), notifier=Notifier(None))
    assert server.health() == (False, "starting: sockets not bound yet")
    server.draining = True
    serving, reason = server.health()
    assert not serving and reason.startswith("draining")
    assert os.environ.get("NOTIFY_SOCKET") is None or server.notifier.address is None
