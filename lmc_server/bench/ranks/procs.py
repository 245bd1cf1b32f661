"""The parent's side of the rank processes of ``lmcache bench ranks``.

:class:`RankProcess` starts ``python -m lmc_server.bench.ranks.worker``
(:class:`~lmc_server.bench.jsonproc.JsonLineProcess`: JSON lines both ways, no pickle); the helpers
send one command to many ranks at once and read what the server still maps.
"""

from __future__ import annotations

import base64
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmc_server.bench.jsonproc import JsonLineProcess
from lmc_server.client.shm import SHM_DIR


class RankProcess(JsonLineProcess):
    """A rank subprocess (``python -m lmc_server.bench.ranks.worker``)."""

    def __init__(self, rank: int, cfg: dict[str, Any]) -> None:
        self.rank = rank
        self.info: dict[str, Any] = {}
        self.killed = False
        super().__init__("lmc_server.bench.ranks.worker", f"rank {rank}", cfg)

    def kill(self) -> None:
        self.killed = True
        self.proc.kill()
        self.proc.wait()

    def close(self, timeout_s: float = 60.0) -> None:
        super().close(timeout_s)
        if self.killed:  # it could not unlink its segments (KV and raw-copy buffers)
            prefix = f"lmc-{self.proc.pid}-"
            for name in os.listdir(SHM_DIR):
                if name.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(SHM_DIR, name))


def gather(
    ranks: Sequence[RankProcess], cmd: dict[str, Any], timeout_s: float
) -> list[dict[str, Any]]:
    """Send ``cmd`` to every rank first, then collect the replies (they run at once)."""
    for r in ranks:
        r.send(cmd)
    return [r.recv(timeout_s) for r in ranks]


def timed_phase(
    procs: Sequence[RankProcess],
    cmd: dict[str, Any],
    duration_s: float,
    kill_one: bool,
    kill: Callable[[RankProcess], None],
) -> tuple[list[RankProcess], list[dict[str, Any]], float]:
    """Send ``cmd`` (a phase of ``duration_s``) to every process; with ``kill_one``
    (and more than one process), ``kill`` the last one halfway. Returns the survivors,
    their replies and the wall time from the send to the last reply."""
    victim = procs[-1] if kill_one and len(procs) > 1 else None
    for r in procs:
        r.send(cmd)
    t0 = time.monotonic()
    if victim is not None:
        time.sleep(duration_s / 2)
        kill(victim)
    survivors = [r for r in procs if r is not victim]
    got = [r.recv(duration_s + 600) for r in survivors]
    return survivors, got, time.monotonic() - t0


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
        bits = bits[: r["stored_chunks"]].astype(bool)
        out[: bits.size] |= bits
    return out
