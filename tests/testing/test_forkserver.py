"""The test zygote (lmc_server/testing/forkserver.py): a forked server is a process of
its own with the environment, arguments, log and exit status it was started with, and
none outlives the zygote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lmc_server.client import Client
from lmc_server.testing.forkserver import ZYGOTE_ENV, Zygote
from lmc_server.testing.process import ServerProcess, free_port, wait_for_ping


def test_a_forked_server_is_its_own_process_with_its_own_env_and_exit_status() -> None:
    env = {**os.environ, "LMCACHE_EVICTION_POLICY": "FIFO"}
    for k in ZYGOTE_ENV:
        env.pop(k, None)
    srv = ServerProcess(["--metrics-port", "0"], env=env)
    assert srv.fork_from_zygote  # tests/conftest.py
    with srv:
        assert srv.proc is not None and srv.proc.pid != os.getpid()
        with Client(srv.endpoint, timeout_s=10) as c:
            assert c.stats().eviction_policy == "FIFO"  # the setting reached the server
        assert "lmcache server" in srv.log()
    assert srv.returncode == 0  # SIGTERM: a clean drain, as from the command


def test_kill_and_a_refused_argument_report_the_status_popen_would() -> None:
    srv = ServerProcess().start()
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGKILL)
    assert srv.proc.wait(10) == -signal.SIGKILL
    srv.kill()  # closes its log
    assert srv.returncode == -signal.SIGKILL
    bad = ServerProcess(["--eviction-policy", "NOPE"])
    with pytest.raises(RuntimeError, match="exited"):
        bad.start()
    assert bad.returncode == 2 and "NOPE" in bad.log()  # click's usage error, as the CLI


def test_servers_die_with_the_zygote() -> None:
    """A zygote whose test process is gone (its stdin closed) kills what it forked."""
    code = (
        "import sys, time\n"
        "from lmc_server.testing.forkserver import Zygote\n"
        "from lmc_server.testing.process import free_port\n"
        "z = Zygote.get(); port = free_port()\n"
        "p = z.spawn(['server', '--port', str(port), '--l1-size-gb', '0.25', "
        "'--metrics-port', '0'], dict(__import__('os').environ), sys.argv[1])\n"
        "print(p.pid, port, flush=True); time.sleep(60)\n"
    )
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        holder = subprocess.Popen(
            [sys.executable, "-c", code, log.name], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout is not None
        pid, port = map(int, holder.stdout.readline().split())
        wait_for_ping(f"tcp://127.0.0.1:{port}", 30)
        holder.kill()  # the test process dies; the zygote sees EOF
        holder.wait()
        holder.stdout.close()
        deadline = time.monotonic() + 20
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            status = Path(f"/proc/{pid}/status").read_text(errors="replace")
            if "State:\tZ" in status:
                break
            time.sleep(0.05)
        alive = Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(
            f"/proc/{pid}/status"
        ).read_text(errors="replace")
        assert not alive, "a forked server outlived its zygote"


def test_the_zygote_answers_many_spawns_at_once() -> None:
    """Two threads forking at the same time each get their own server."""
    import threading

    z = Zygote.get()
    got: list[int] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with tempfile.NamedTemporaryFile(suffix=".log") as log:
                port = free_port()
                p = z.spawn(
                    ["server", "--port", str(port), "--l1-size-gb", "0.25", "--metrics-port", "0"],
                    dict(os.environ),
                    log.name,
                )
                wait_for_ping(f"tcp://127.0.0.1:{port}", 30, p)
                got.append(p.pid)
                p.send_signal(signal.SIGTERM)
                assert p.wait(20) == 0
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(got)) == 3
