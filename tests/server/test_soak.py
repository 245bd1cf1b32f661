"""Soak: workers come and go (many killed with SIGKILL mid-operation) for a while.

Afterwards the server's memory and file descriptors are back where they were, it maps no
worker's shared memory and no worker left a segment in /dev/shm, no worker ever read a
wrong byte, no survivor saw an error, and the index holds nothing half-written or pinned.
The short configuration runs in CI; the long one (a few minutes) runs with
``pytest -m soak``; ``LMC_SOAK_S`` overrides its length. The monitoring client holds no
registration and is quiet while the workers run, longer than the server's idle-session
interval in the long run: a connected client must never be forgotten for that
(``tests/server/test_hardening_sessions.py::test_quiet_connected_client_is_not_forgotten`` covers
it in CI with a clock moved forward).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmc_server.client import Client
from lmc_server.testing.process import ServerProcess

WORKER = str(Path(__file__).resolve().parents[1] / "soakworker.py")


def server_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def snapshot(srv: ServerProcess) -> dict[str, int]:
    """Server memory and descriptors, and the worker segments it still maps."""
    assert srv.proc is not None
    pid = srv.proc.pid
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {
        "rss": server_rss_bytes(pid),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "mapped_segments": len(
            {
                line.split()[-2] if line.endswith("(deleted)") else line.split()[-1]
                for line in maps.splitlines()
                if "/dev/shm/lmc-" in line
            }
        ),
    }


def run_soak(duration_s: float, concurrency: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    with (
        ServerProcess(["--separate-object-groups", "--slab-size-mb", "16"], l1_size_gb=0.25) as srv,
        Client(srv.endpoint) as c,
    ):
        t0 = time.monotonic()
        while c.stats().l1.ready_bytes < c.stats().l1.capacity_bytes:
            assert time.monotonic() - t0 < 30
            time.sleep(0.1)
        before = snapshot(srv)
        live: list[subprocess.Popen[str]] = []
        pids: list[int] = []
        totals = {"ops": 0, "mismatches": 0, "errors": 0, "killed": 0, "finished": 0}
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline or live:
            while len(live) < concurrency and time.monotonic() < deadline:
                w = subprocess.Popen(
                    [
                        sys.executable,
                        WORKER,
                        srv.endpoint,
                        str(rng.randrange(1 << 30)),
                        str(rng.uniform(1, 4)),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                assert w.stdout is not None and w.stdout.readline() == "ready\n"
                live.append(w)
                pids.append(w.pid)
            time.sleep(rng.uniform(0.2, 0.8))
            if live and rng.random() < 0.5:
                victim = live.pop(rng.randrange(len(live)))
                victim.kill()
                victim.communicate()
                totals["killed"] += 1
            for w in list(live):
                if w.poll() is not None:
                    out, err = w.communicate()
                    live.remove(w)
                    assert w.returncode == 0, err
                    line = json.loads(out.strip().splitlines()[-1])
                    for k in ("ops", "mismatches", "errors"):
                        totals[k] += line[k]
                    totals["finished"] += 1
        t1 = time.monotonic()
        while c.stats().registrations or c.stats().leases:
            assert time.monotonic() - t1 < 10, "killed workers were not reaped"
            time.sleep(0.1)
        report = c.stats()
        for p in report.partitions:
            assert p.writing == 0 and p.pinned_objects == 0, p
            assert p.used_bytes == p.objects * p.object_bytes
        after = snapshot(srv)
    print(f"soak {duration_s:.0f} s: {totals}; before {before}; after {after}")
    assert totals["mismatches"] == 0 and totals["errors"] == 0, totals
    assert totals["killed"] >= 1 and totals["finished"] >= 1 and totals["ops"] > 0
    assert after["fds"] <= before["fds"] + 2, (before, after)
    assert after["rss"] <= before["rss"] + 64 * 2**20, (before, after)
    assert before["mapped_segments"] == 0 and after["mapped_segments"] == 0, after
    left = [f for f in os.listdir("/dev/shm") if any(f.startswith(f"lmc-{p}-") for p in pids)]
    assert not left, f"workers' shared memory left behind: {left}"
    return totals


def test_soak_short() -> None:
    run_soak(duration_s=15, concurrency=3, seed=1)


@pytest.mark.soak
def test_soak_long() -> None:
    run_soak(duration_s=float(os.environ.get("LMC_SOAK_S", "180")), concurrency=4, seed=2)
