"""Failures as they happen in production: kill -9 of clients and of the server.

Each test kills a real worker process at a chosen point and checks, through the server's
own report, that what the worker held (registrations, mappings, leases, unfinished
writes) is reclaimed within 5 seconds, that nothing partial became visible, and that
every chunk the server still reports comes back byte-exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmc_server.client import Client, ServerError, chunk_digests
from lmc_server.protocol.stats import StatsReport
from lmc_server.testing import ShmKV, dsv41_flash
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.poll import wait_for
from lmc_server.testing.process import ServerProcess

WORKER = str(Path(__file__).resolve().parents[1] / "kvworker.py")
NUM_BLOCKS = 128
REAP_S = 5.0


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    # 1 GiB: test_kill9_mid_store_leaves_nothing_partial keeps three or more batches of
    # 16 preset chunks (86 MB each) and checks them all afterwards
    with ServerProcess(["--chunk-size", "256", "--separate-object-groups"], l1_size_gb=1) as s:
        yield s


def spawn(endpoint: str, **kw: Any) -> subprocess.Popen[str]:
    args = {
        "endpoint": endpoint,
        "num_blocks": NUM_BLOCKS,
        "seed": 7,
        "token_seed": 1000,
        "block_seed": 3,
        **kw,
    }
    return subprocess.Popen(
        [sys.executable, WORKER, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_line(proc: subprocess.Popen[str], prefix: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"worker ended early: {proc.stderr.read() if proc.stderr else ''}")
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no {prefix!r} from the worker")


def kill9(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def eventually(cond: Callable[[], bool], timeout_s: float = REAP_S) -> float:
    t0 = time.monotonic()
    wait_for(cond, "the condition", timeout_s)
    return time.monotonic() - t0


def server_maps(srv: ServerProcess) -> str:
    assert srv.proc is not None
    return Path(f"/proc/{srv.proc.pid}/maps").read_text()


def check_consistent(c: Client) -> StatsReport:
    """No object half-written, pool use equals committed objects, nothing pinned."""
    report = c.stats()
    for p in report.partitions:
        assert p.writing == 0, p
        assert p.used_bytes == p.objects * p.object_bytes, p
        assert p.pinned_objects == 0, p
    return report


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, n * 256)


def verify_batches(c: Client, batches: int, n: int) -> int:
    """Every chunk the server reports for the worker's batches comes back byte-exact."""
    checked = 0
    with (
        ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as src,
        ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as dst,
    ):
        src.fill_random(7)
        reg = c.register(**dst.register_kwargs())
        src_ids = block_ids_for(reg, n, np.random.default_rng(3))
        for b in range(batches + 1):
            digests = chunk_digests(tokens(1000 + b, n), 256)
            look = c.lookup(reg, digests)
            k = look.hit_chunks
            if not k:
                continue
            dst.fill(0)
            ids = block_ids_for(reg, k, np.random.default_rng(50 + b))
            assert c.retrieve(reg, digests[: 32 * k], ids).ok.all()
            for g in reg.groups:
                if not g.cached:
                    continue
                bpc = reg.blocks_per_chunk(g)
                a = src_ids[g.name].reshape(n, bpc)[:k]
                d = ids[g.name].reshape(k, bpc)
                if g.kind == "sliding_window":
                    a, d = a[-1:, bpc // 2 :], d[-1:, bpc // 2 :]
                assert src.pages(g.name, a.ravel().tolist()) == dst.pages(
                    g.name, d.ravel().tolist()
                ), f"batch {b} group {g.name}"
            c.release(look.lease_id)
            checked += k
        c.unregister(reg)
    return checked


def test_kill9_mid_store_leaves_nothing_partial(srv: ServerProcess) -> None:
    n = 16
    with Client(srv.endpoint) as c:
        base = c.stats()
        w = spawn(srv.endpoint, loop=True, chunks=n)
        wait_line(w, "storing 3")
        time.sleep(0.01)
        last = int(wait_line(w, "storing").split()[1])
        kill9(w)
        took = eventually(lambda: c.stats().registrations == base.registrations)
        # unmapped once the store it was copying returns (the copy may outlive the drop)
        eventually(lambda: f"lmc-{w.pid}-" not in server_maps(srv))
        eventually(lambda: all(p.writing == 0 for p in c.stats().partitions))
        check_consistent(c)
        assert verify_batches(c, last, n) >= 3 * n
        print(f"reaped in {took:.2f} s")


def test_kill9_between_lookup_and_retrieve_releases_the_lease(srv: ServerProcess) -> None:
    with Client(srv.endpoint) as c:
        w = spawn(srv.endpoint, lookup_then_hang=True, chunks=4)
        lease = json.loads(wait_line(w, '{"lease"'))["lease"]
        assert lease and c.stats().leases == 1
        kill9(w)
        eventually(lambda: c.stats().leases == 0 and c.stats().registrations == 0)
        assert not c.release(lease)
        check_consistent(c)


def test_kill9_mid_retrieve_unpins_and_reaps(srv: ServerProcess) -> None:
    with Client(srv.endpoint) as c:
        w = spawn(srv.endpoint, retrieve_loop=True, chunks=16)
        wait_line(w, "retrieving 3")
        kill9(w)
        eventually(lambda: c.stats().registrations == 0)
        eventually(lambda: all(p.pinned_objects == 0 for p in c.stats().partitions))
        check_consistent(c)
        assert c.stats().l1.objects == 2 * 16  # what it stored stays


def test_a_stopped_client_shorter_than_the_timeout_is_not_reaped(srv: ServerProcess) -> None:
    with Client(srv.endpoint) as c:
        w = spawn(srv.endpoint, hang=True, chunks=2)
        wait_line(w, "{")
        assert c.stats().registrations == 1
        os.kill(w.pid, signal.SIGSTOP)
        time.sleep(2.0)
        assert c.stats().registrations == 1
        os.kill(w.pid, signal.SIGCONT)
        time.sleep(0.5)
        assert c.stats().registrations == 1
        kill9(w)
        eventually(lambda: c.stats().registrations == 0)


def test_kill9_server_then_restart_clients_recover() -> None:
    args = ["--chunk-size", "256", "--separate-object-groups"]
    first = ServerProcess(args).start()
    assert first.proc is not None
    first_pid, second_pid = first.proc.pid, -1
    shm_before = set(os.listdir("/dev/shm"))
    with Client(first.endpoint, timeout_s=2) as c, ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as kv:
        kv.fill_random(1)
        reg = c.register(**kv.register_kwargs())
        digests = chunk_digests(tokens(5, 2), 256)
        assert c.store(reg, digests, block_ids_for(reg, 2)).ok.all()
        first.kill()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            c.lookup(reg, digests)
        assert time.monotonic() - t0 < 3
        second = ServerProcess(args, port=first.port).start()
        assert second.proc is not None
        second_pid = second.proc.pid
        try:
            c.timeout_s = 10
            with pytest.raises(ServerError) as e:
                c.lookup(reg, digests)
            assert e.value.code in ("unknown_registration", "handshake")
            with Client(second.endpoint) as fresh:
                reg2 = fresh.register(**kv.register_kwargs())
                assert fresh.lookup(reg2, digests).hit_chunks == 0  # L1 is volatile
                assert fresh.store(reg2, digests, block_ids_for(reg2, 2)).ok.all()
        finally:
            assert second.terminate() == 0
    # segments are named lmc-<creator pid>-...: look at this test's and its servers' only
    # (other processes on a shared machine come and go)
    ours = tuple(f"lmc-{pid}-" for pid in (os.getpid(), first_pid, second_pid))
    left = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(ours)}
    assert not left, f"server left shared memory behind: {left}"
