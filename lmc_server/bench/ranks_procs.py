"""The parent's side of the rank processes of ``lmcache bench ranks``.

:class:`RankProcess` starts ``python -m lmc_server.bench.ranks_worker`` and turns its
stdout lines into dicts on a thread (JSON lines both ways, no pickle); the helpers
send one command to many ranks at once and read what the server still maps.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from lmc_server.client.shm import SHM_DIR


class RankProcess:
    """A rank subprocess and a thread that turns its stdout lines into dicts."""

    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.rank = rank
        self.log: IO[bytes] = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "lmc_server.bench.ranks_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log)
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"lmc-bench-rank{rank}",
                                        daemon=True)
        self._reader.start()
        self.info: dict[str, Any] = {}
        self.killed = False
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
            raise TimeoutError(f"rank {self.rank}: no reply within {timeout_s:.0f} s"
                               ) from None
        if reply is None or "error" in reply:
            what = "exited" if reply is None else reply["error"]
            raise RuntimeError(f"rank {self.rank} failed: {what}\n{self.stderr()}")
        return reply

    def call(self, obj: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(obj)
        return self.recv(timeout_s)

    def kill(self) -> None:
        self.killed = True
        self.proc.kill()
        self.proc.wait()

    def close(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None and not self.killed:
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
                except OSError:  # stdin of a killed rank: nothing to flush into
                    pass
        if self.killed:  # it could not unlink its segments (KV and raw-copy buffers)
            prefix = f"lmc-{self.proc.pid}-"
            for name in os.listdir(SHM_DIR):
                if name.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(SHM_DIR, name))
        self.log.close()


def gather(ranks: Sequence[RankProcess], cmd: dict[str, Any], timeout_s: float
            ) -> list[dict[str, Any]]:
    """Send ``cmd`` to every rank first, then collect the replies (they run at once)."""
    for r in ranks:
        r.send(cmd)
    return [r.recv(timeout_s) for r in ranks]


def maps_hold(pid: int, names: Sequence[str]) -> bool | None:
    """Whether process ``pid`` still maps any of the shm segments ``names``."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return any(n in maps for n in names)


def union_bits(replies: Sequence[dict[str, Any]], key: str, og: str) -> np.ndarray:
    n = max((r["stored_chunks"] for r in replies), default=0)
    out = np.zeros(n, dtype=bool)
    for r in replies:
        bits = np.unpackbits(np.frombuffer(base64.b64decode(r[key][og]), dtype=np.uint8))
        bits = bits[:r["stored_chunks"]].astype(bool)
        out[:bits.size] |= bits
    return out
