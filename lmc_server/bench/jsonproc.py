"""A benchmark's helper process that speaks JSON lines on stdin and stdout (no pickle).

:class:`JsonLineProcess` starts ``python -m MODULE``, sends it one config line, and
turns its stdout lines into dicts on a reader thread; a reply with an ``error`` key, or
the process exiting, raises with the tail of its stderr. :func:`serve_lines` is the
other end: it answers each command line with one JSON line.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import IO, Any


def reply(obj: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed (the parent waits for it)."""
    print(json.dumps(obj), flush=True)


def serve_lines(handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Answer each command line on stdin (``{"cmd": NAME, ...}``) with what
    ``handlers[NAME]`` returns, until ``exit`` or the end of stdin; an unknown or failing
    command is answered with its error (the traceback on stderr), and the next is read."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        try:
            handler = handlers.get(cmd["cmd"])
            out = handler(cmd) if handler else {"error": f"unknown command {cmd['cmd']!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
            traceback.print_exc()
            out = {"error": f"{type(e).__name__}: {e}"}
        reply(out)


class JsonLineProcess:
    def __init__(self, module: str, name: str, cfg: dict[str, Any]) -> None:
        self.name = name
        self.log: IO[bytes] = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"lmc-bench-{name}", daemon=True)
        self._reader.start()
        self.send(cfg)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def recv(self, timeout_s: float) -> dict[str, Any]:
        try:
            reply = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"{self.name}: no reply within {timeout_s:.0f} s\n{self.stderr()}"
            ) from None
        if reply is None or "error" in reply:
            what = "exited" if reply is None else reply["error"]
            raise RuntimeError(f"{self.name} failed: {what}\n{self.stderr()}")
        return reply

    def call(self, obj: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(obj)
        return self.recv(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        self.log.close()

    def __enter__(self) -> JsonLineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
