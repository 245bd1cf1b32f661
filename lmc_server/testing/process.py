"""Run a real ``lmcache server`` process for tests and benchmarks.

    with ServerProcess(["--l1-size-gb", "1"]) as srv:
        Client(srv.endpoint).ping()

The server runs as ``python -m lmc_server server`` on a free port with the CPU backend
by default; leaving the block sends SIGTERM and checks the exit status is 0. Where
:attr:`ServerProcess.fork_from_zygote` is set (the test suite sets it) a CPU- or
null-backend server is instead forked from a process that imported the package once
(:mod:`lmc_server.testing.forkserver`): the same entry point and arguments, a process
of its own, without the 0.4 s of CPU that each import costs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol

import zmq

from lmc_server.net import tcp_endpoint
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.testing.poll import wait_for


class Proc(Protocol):
    """What is used of a server's process: a :class:`subprocess.Popen`, or a
    :class:`~lmc_server.testing.forkserver.ForkedProcess`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: How often the start-up probe reconnects while the server is not bound yet, and how
#: long it waits for an answer before it looks at the process again.
_PROBE_RECONNECT_MS = 10
_PROBE_POLL_MS = 20


def wait_for_ping(
    endpoint: str,
    timeout_s: float,
    proc: Proc | None = None,
    ready: bool = False,
) -> float:
    """Seconds until the server at ``endpoint`` answers ping (and is ready, if asked).

    One DEALER socket, connected before the server binds: zmq keeps the ping queued and
    delivers it on the first connect that succeeds, retried every
    ``_PROBE_RECONNECT_MS`` (zmq's default is 100 ms), so the answer comes within a few
    milliseconds of the bind instead of at the next round of a poll-and-sleep loop. A
    server that answers but is not ready yet is asked again; an exited one is an error.
    """
    t0 = time.monotonic()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, _PROBE_RECONNECT_MS)
        sock.connect(endpoint)
        ping = encode(m.Ping(req_id=1))
        sock.send(ping)
        while True:
            if sock.poll(_PROBE_POLL_MS):
                reply = decode_reply(sock.recv())
                if isinstance(reply, m.Pong) and (reply.ready or not ready):
                    return time.monotonic() - t0
                time.sleep(_PROBE_POLL_MS / 1000)  # answered, not ready yet: ask again
                sock.send(ping)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with status {proc.returncode} before answering ping"
                )
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"server at {endpoint} did not answer within {timeout_s} s")
    finally:
        sock.close(linger=0)
        ctx.term()


def wait_pool_ready(endpoint: str, timeout_s: float = 120.0) -> float:
    """Seconds until every slab of the pool is prepared (pinned, on cuda).

    The server answers as soon as one slab is ready and prepares the rest in the
    background; a test whose raw stores must not meet ``busy`` (a store that found no
    room while the pool is still being prepared) waits here first.
    """
    from lmc_server.client import Client

    t0 = time.monotonic()
    with Client(endpoint, timeout_s=timeout_s, client_name="pool-wait") as c:

        def ready() -> bool:
            l1 = c.stats().l1
            return l1.ready_bytes == l1.capacity_bytes

        wait_for(ready, "every slab of the pool prepared", timeout_s, error=TimeoutError)
    return time.monotonic() - t0


#: Backends whose servers may be forked from the zygote: those that never touch CUDA
#: (a CUDA context needs a fresh process).
ZYGOTE_BACKENDS = ("cpu", "null")

#: A directory: every :class:`ServerProcess` writes its whole log there when it ends
#: (device runs set it to their output folder, so a failure can be read afterwards).
KEEP_LOGS_ENV = "LMC_KEEP_SERVER_LOGS"


class ServerProcess:
    """A server subprocess; ``log()`` returns what it wrote to stderr so far.

    :meth:`start` returns once the server answers ping; with ``pool_ready`` (default:
    :attr:`pool_ready_by_default`) also once every slab of its pool is prepared, so a
    store right after start cannot be answered ``busy`` for want of a slab still being
    prepared (on a loaded machine the preparing thread may lag the first requests).

    ``l1_size_gb`` defaults to 0.25 (four 64 MiB slabs): what a test stores fits, and
    a pool's preparation is not free. Every page of the cpu engine's pool is populated
    by the server, about 1.2 s of CPU per GiB on a 2-core VM (zeroing it, huge
    pages or not), and the suite waits for it. A test or benchmark that needs room asks for it;
    every GPU test and every benchmark names its size.
    """

    #: The test suite sets this (tests/conftest.py); benchmarks that time the pool's
    #: preparation keep the default and wait (or not) themselves.
    pool_ready_by_default = False
    #: Fork CPU- and null-backend servers from the zygote instead of starting an interpreter each
    #: (the test suite sets it; ``LMC_TEST_ZYGOTE=0`` in the environment turns it off).
    fork_from_zygote = False

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        backend: str = "cpu",
        l1_size_gb: float = 0.25,
        start_timeout_s: float = 20.0,
        env: dict[str, str] | None = None,
        metrics_port: int = 0,
        host: str = "127.0.0.1",
        pool_ready: bool | None = None,
    ) -> None:
        self.port = port or free_port()
        self.endpoint = tcp_endpoint(host, self.port)
        self.args = [
            "--host",
            host,
            "--port",
            str(self.port),
            "--backend",
            backend,
            "--l1-size-gb",
            str(l1_size_gb),
            "--metrics-port",
            str(metrics_port),
            *args,
        ]
        self.start_timeout_s = start_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.backend = backend
        self.proc: Proc | None = None
        self._log: IO[bytes] | None = None
        self.returncode: int | None = None
        self._final_log = ""
        self.pool_ready = self.pool_ready_by_default if pool_ready is None else pool_ready

    def start(self) -> ServerProcess:
        if (
            self.fork_from_zygote
            and self.backend in ZYGOTE_BACKENDS
            and os.environ.get("LMC_TEST_ZYGOTE", "1") != "0"
        ):
            from lmc_server.testing.forkserver import Zygote

            fd, path = tempfile.mkstemp(prefix="lmc-server-", suffix=".log")
            self._log = os.fdopen(fd, "w+b")
            try:
                self.proc = Zygote.get().spawn(["server", *self.args], self.env, path)
            finally:
                os.unlink(path)  # the child and self._log hold it open
        else:
            self._log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmc_server", "server", *self.args],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        try:
            wait_for_ping(self.endpoint, self.start_timeout_s, self.proc)
            if self.pool_ready:
                wait_pool_ready(self.endpoint)
        except BaseException:
            self.kill()
            raise
        return self

    def wait_pool_ready(self, timeout_s: float = 120.0) -> float:
        """Seconds until every slab of the pool is prepared (see :func:`wait_pool_ready`)."""
        return wait_pool_ready(self.endpoint, timeout_s)

    def log(self) -> str:
        if self._log is None:
            return self._final_log
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def _close_log(self) -> None:
        if self._log is not None:
            self._final_log = self.log()
            self._log.close()
            self._log = None
            keep = os.environ.get(KEEP_LOGS_ENV)
            if keep:
                # GPU runs keep every server's log for reading afterwards
                path = Path(keep) / f"server-{self.port}-{int(time.time())}.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(self._final_log)

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        """Signal the server and wait; returns its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
            finally:
                self._close_log()
        self.returncode = code = self.proc.wait()
        self._close_log()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            self.returncode = self.proc.returncode
        self._close_log()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            code = self.terminate()
            if exc_type is None and code != 0:
                raise RuntimeError(f"server exited with {code}:\n{self.log()}")
        self._close_log()
