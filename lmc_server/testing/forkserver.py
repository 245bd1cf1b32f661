"""A parent process that has imported the server once and forks test servers from it.

Why: a ``python -m lmc_server server`` spends about 0.4 s of CPU importing numpy, zmq,
click and the server's own modules before it serves. The test suite starts about 150
servers, so on the 2-core CI machine that import was a fifth of the suite's CPU. A
fork of a process that has done the import already costs milliseconds. What the child
then runs is what ``lmcache server`` runs: :func:`lmc_server.cli.main.cli` with the
same arguments, in a process of its own (its own pid, sockets, environment, working
directory, signals and exit status, its output in its own log file). Only the import is
shared. The child runs the package as ``python -m lmc_server`` does (``runpy``), and
the zygote imports the command's modules by name: like a test that starts the command
as a subprocess, this module depends on the command, not on the CLI layer's code.
Tests that are about how the command starts (tests/cli/test_cli.py and the others that run
``python -m lmc_server`` themselves) do not come here.

Invariants of the zygote (``serve``): it stays single-threaded, because it forks and a
fork of a threaded process can inherit a lock some other thread held (it checks, and
refuses to fork otherwise); it never creates a zmq context, an event loop or CUDA state
(CUDA needs a fresh process: only CPU- and null-backend servers come here, see
:class:`~lmc_server.testing.process.ServerProcess`); it reaps its children and reports
each exit status; and when the process that started it goes (EOF on its stdin) it kills
the children it still has and exits, so no server outlives a test run.

Wire (one JSON object per line): request ``{"id", "argv", "env", "cwd", "log"}`` ->
``{"id", "pid"}`` or ``{"id", "error"}``; then, at any time, ``{"exit": pid, "code":
returncode}`` (negative: killed by that signal, as :class:`subprocess.Popen` reports).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

#: What ``python -m lmc_server server`` imports before it serves: done once, here.
PRELOAD = ("lmc_server.cli.main", "lmc_server.server.server", "lmc_server.transfer.cpu")
#: A fork answers within milliseconds; the first one waits for the zygote's import.
SPAWN_TIMEOUT_S = 60.0
#: The zygote must not start BLAS threads at numpy's import (it forks).
ZYGOTE_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _child(req: dict[str, Any], log_fd: int) -> None:
    """In the forked child: become the server process the request asks for. Never
    returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.closerange(3, 1 << 16)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["lmcache", *req["argv"]]
        try:
            runpy.run_module("lmc_server", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _send(msg: dict[str, Any]) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(1, data) :]


def serve() -> None:
    """The zygote's loop (its process's main): import, then fork on request."""
    for name in PRELOAD:  # by name: the children run the command, as `python -m` would
        importlib.import_module(name)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    buf = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:  # reap every exited child, report its status
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the test process went: so do its servers
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if threading.active_count() != 1:
                _send({"id": req["id"], "error": "the zygote has threads; it cannot fork"})
                continue
            try:
                log_fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
            except OSError as e:
                _send({"id": req["id"], "error": f"log file: {e}"})
                continue
            pid = os.fork()
            if pid == 0:
                os.close(wake_r)
                os.close(wake_w)
                _child(req, log_fd)
            os.close(log_fd)
            children.add(pid)
            _send({"id": req["id"], "pid": pid})


class ForkedProcess:
    """The :class:`subprocess.Popen` surface the tests use (``pid``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``) for a server
    forked by the zygote; its exit status arrives from the zygote, which reaps it."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not yet reaped: the pid is still ours
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's end: starts the zygote on first use, one per process."""

    _instance: Zygote | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> Zygote:
        with cls._instance_lock:
            if cls._instance is None or cls._instance._dead:
                cls._instance = Zygote()
            return cls._instance

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from lmc_server.testing.forkserver import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **ZYGOTE_ENV},
        )
        self._lock = threading.Lock()
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._reply_ready = threading.Condition(self._lock)
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._dead = False
        threading.Thread(target=self._read, name="lmc-zygote-reader", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if "exit" in msg:
                    child = self._children.pop(msg["exit"], None)
                    if child is None:
                        self._early_exits[msg["exit"]] = msg["code"]
                    else:
                        child._exited(msg["code"])
                else:
                    self._replies[msg["id"]] = msg
                    self._reply_ready.notify_all()
        with self._lock:  # the zygote is gone: so are its children
            self._dead = True
            for child in self._children.values():
                child._exited(-signal.SIGKILL)
            self._children.clear()
            self._reply_ready.notify_all()

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> ForkedProcess:
        """Fork a server running ``lmcache <argv>``, its output appended to ``log_path``."""
        assert self._proc.stdin is not None
        with self._lock:
            if self._dead:
                raise RuntimeError("the test zygote exited")
            rid = self._next_id
            self._next_id += 1
            req = {"id": rid, "argv": argv, "env": env, "cwd": os.getcwd(), "log": log_path}
            self._proc.stdin.write((json.dumps(req) + "\n").encode())
            self._proc.stdin.flush()
            deadline = time.monotonic() + SPAWN_TIMEOUT_S
            while rid not in self._replies:
                if self._dead:
                    raise RuntimeError("the test zygote exited")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the test zygote did not fork in {SPAWN_TIMEOUT_S} s")
                self._reply_ready.wait(1.0)
            reply = self._replies.pop(rid)
            if "error" in reply:
                raise RuntimeError(f"the test zygote could not fork: {reply['error']}")
            child = ForkedProcess(reply["pid"], ["lmcache", *argv])
            code = self._early_exits.pop(child.pid, None)
            if code is None:
                self._children[child.pid] = child
            else:
                child._exited(code)
            return child
