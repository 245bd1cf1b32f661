"""systemd integration: sd_notify over a fake NOTIFY_SOCKET, and the unit file.

The test binds the datagram socket systemd would, runs a real server with
``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` set, and checks what arrives: ``READY=1`` (with
a ``STATUS=`` line) while serving, ``WATCHDOG=1`` pings at half the watchdog interval,
and ``STOPPING=1`` on SIGTERM, in that order. Waits end when the datagram arrives (no
sleeps). What the watchdog does while a copy is stuck runs in process, with a copy the
test holds; a stuck event loop is in ``tests/server/test_lifecycle.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server.client import Client, chunk_digests
from lmc_server.server.notify import Notifier
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.engines import HoldingEngine
from lmc_server.testing.inprocess import run_server
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.systemd import FakeSystemd

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "lmcache-server.service"


@pytest.fixture(params=[False, True], ids=["path", "abstract"])
def fake_systemd(request: pytest.FixtureRequest) -> Iterator[FakeSystemd]:
    fs = FakeSystemd(abstract=request.param)
    try:
        yield fs
    finally:
        fs.close()


def test_ready_status_watchdog_and_stopping_arrive(fake_systemd: FakeSystemd) -> None:
    """The environment contract, in a process: NOTIFY_SOCKET, WATCHDOG_USEC, MAINPID."""
    env = {"NOTIFY_SOCKET": fake_systemd.env_value, "WATCHDOG_USEC": "400000"}
    srv = ServerProcess(["--l1-size-gb", "1"], env=env)
    with srv:
        ready_t = fake_systemd.wait_for("READY=1")
        with Client(srv.endpoint, timeout_s=10) as c:
            c.ping()  # READY=1 promised the socket was bound: it answers
        ready = next(lines for _, lines in fake_systemd.messages if "READY=1" in lines)
        assert any(a.startswith("STATUS=serving on ") for a in ready), ready
        assert f"MAINPID={srv.proc.pid}" in ready  # type: ignore[union-attr]
        fake_systemd.wait_count("WATCHDOG=1", 3)  # every 0.2 s
        # the last slab prepared is reported (a loaded machine pins slowly)
        fake_systemd.wait_until(
            lambda: any("L1 pool ready" in a for _, lines in fake_systemd.messages for a in lines),
            "STATUS=... L1 pool ready",
            timeout_s=60,
        )
        assert srv.terminate() == 0
    stop_t = fake_systemd.wait_for("STOPPING=1")
    assert stop_t > ready_t
    statuses = [a for a in fake_systemd.assignments() if a.startswith("STATUS=")]
    assert any(s.startswith("STATUS=draining") for s in statuses), statuses
    assert "systemd notified: ready, watchdog every 0.2 s" in srv.log()


def test_a_copy_stuck_in_the_engine_stops_neither_the_loop_nor_the_watchdog() -> None:
    """Copies run off the event loop: while one is stuck, watchdog pings go on, the
    server is healthy and serves other clients; released, the request completes."""
    engine = HoldingEngine()
    with (
        FakeSystemd() as systemd,
        ShmKV(simple_model()) as kv,
        run_server(engine=engine, notifier=systemd.notifier(watchdog_interval_s=0.01)) as ts,
        Client(ts.endpoint) as c,
    ):
        kv.fill_random(2)
        reg = c.register(**kv.register_kwargs())
        done = threading.Event()
        result: list[bool] = []

        def store() -> None:
            result.append(
                bool(
                    c.store(reg, chunk_digests(np.arange(256), 256), block_ids_for(reg, 1)).ok.all()
                )
            )
            done.set()

        worker = threading.Thread(target=store)
        worker.start()
        try:
            engine.wait_held()
            beats = systemd.count("WATCHDOG=1")
            systemd.wait_count("WATCHDOG=1", beats + 3)
            assert ts.server.health()[0]
            with Client(ts.endpoint) as other:
                assert other.ping().ready
            assert not done.is_set()
        finally:
            engine.release()
            worker.join(10)
        assert done.is_set() and result == [True]


def test_no_notify_socket_means_no_notifications() -> None:
    n = Notifier.from_env({})
    assert not n.enabled and n.watchdog_interval_s is None
    assert n.ready("x") is False


def test_watchdog_for_another_pid_is_ignored() -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}
    assert Notifier.from_env(env, pid=1234).watchdog_interval_s is None
    assert Notifier.from_env(env, pid=1).watchdog_interval_s == 15.0


def test_unreachable_socket_does_not_raise(tmp_path: Path) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "missing")})
    assert n.enabled
    assert n.send("READY=1") is False
    assert n.stopping("bye") is False
    n.close()


def test_unit_file_has_the_promised_settings() -> None:
    text = UNIT.read_text()
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            settings.setdefault(m[1], []).append(m[2])
    assert settings["Type"] == ["notify"]
    assert settings["Restart"] == ["on-failure"]
    assert settings["LimitMEMLOCK"] == ["infinity"]
    assert "WatchdogSec" in settings and "EnvironmentFile" in settings
    assert "DynamicUser" not in settings
    assert settings.get("PrivateDevices", ["no"]) == ["no"]
    assert settings.get("RemoveIPC", ["no"]) == ["no"]  # the engine shares the user's IPC
    assert any("nvidia" in d for d in settings["DeviceAllow"])
    assert any(e.startswith("CUPY_CACHE_DIR=") for e in settings["Environment"])
    env_file = (REPO / "deploy" / "lmcache-server.env").read_text()
    from lmc_server.cli.main import server as server_cmd

    for p in server_cmd.params:
        envvar = getattr(p, "envvar", None)
        if envvar:
            assert envvar in env_file, f"{envvar} is not documented in the env file"


@pytest.mark.needs_tool("systemd-analyze", "Debian: systemd; CI: .ci/install-ops-tools.sh")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit as shipped, with ExecStart pointed at this environment's executable.

    CI runs this on whatever systemd its image has (Debian 12: 252); the unit uses no key
    newer than 252, so the check is the same on 252 and on every later version.
    """
    lmcache = Path(sys.executable).with_name("lmcache")
    text = UNIT.read_text()
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={lmcache}", text, flags=re.M)
    unit = tmp_path / "lmcache-server.service"
    unit.write_text(text)
    res = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    problems = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    # No filter: every key must be known to the oldest supported systemd (252, Debian 12
    # and RHEL 9), so any warning at all, an unknown key included, fails.
    assert res.returncode == 0 and not problems, problems
