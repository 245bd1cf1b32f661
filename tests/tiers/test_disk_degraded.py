"""L1 serves on, byte for byte, while a tier below it is full, hung or gone.

Real server processes, real files, a real redis-server. In each case: stores succeed,
L1 hits come back exactly as stored, the lower tier's failures are counted, nothing
wrong is served from it, and the server answers (a client whose timeout is a few
seconds gets every reply; no timing of speed).

- full: a disk capacity smaller than one object (the tier refuses every write as a
  counted error and stays up; no file is left on disk past the capacity);
- slow: a disk that cannot keep up with the stores (a write queue of two objects): the
  overflow dropped and counted, whatever was written served from the disk exactly;
- hung: the Redis below the disk stopped (SIGSTOP): every L2 call times out, counted,
  the tier degraded; the disk and L1 serve on, and L2 comes back after SIGCONT;
- gone: the Redis below the disk tier killed (L2 writes dropped and counted, the disk
  tier and L1 serve on).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from lmc_server.client import Client, chunk_digests
from lmc_server.testing.redis_process import RedisProcess
from lmc_server.testing.tierworker import (
    CHUNK,
    Worker,
    disk_server,
    disk_stats,
    retrieve_exact,
    tokens,
    value_files,
    wait_for,
)

ARGS = [
    "--chunk-size",
    str(CHUNK),
    "--separate-object-groups",
    "--eviction-policy",
    "LRU",
    "--l2-timeout-s",
    "0.5",
]
#: Every reply the checks below wait for comes well within this (a generous bound on
#: "the server still answers", not a measure of speed).
ANSWER_S = 10.0


def l1_serves(src: Worker, dst: Worker, seed: int, n: int = 3) -> None:
    """A store on ``src`` succeeds and is an L1 hit on ``dst`` (same server, another
    worker), byte for byte, each reply within :data:`ANSWER_S`."""
    digests = chunk_digests(tokens(seed, n), CHUNK)
    ids = src.store(digests, block_seed=seed)
    retrieve_exact(dst, src, ids, digests, n)


def quick_workers(endpoint: str, seed: int) -> tuple[Worker, Worker]:
    """A storing worker and an empty one whose clients wait at most :data:`ANSWER_S`
    for any reply (a late one fails the test)."""
    src, dst = Worker(endpoint, seed=seed), Worker(endpoint, seed=0)
    for w in (src, dst):
        w.client.timeout_s = ANSWER_S
    return src, dst


def test_disk_smaller_than_one_object_refuses_writes_and_l1_serves(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    capacity = 1 << 20  # the preset's objects are 2.0 and 3.3 MB
    with disk_server(directory, size_gb=capacity / (1 << 30)) as a:
        src, dst = quick_workers(a.endpoint, seed=7)
        try:
            wait_for(lambda: disk_stats(src.client).state == "up", "disk tier up")
            for i in range(3):
                l1_serves(src, dst, seed=40 + i)
            wait_for(
                lambda: disk_stats(src.client).errors.get("write", 0) >= 1, "refused writes counted"
            )
            wait_for(
                lambda: (
                    (st := disk_stats(src.client)).write_queue_objects == 0
                    and st.writes_in_flight == 0
                ),
                "write queue drained",
            )
            st = disk_stats(src.client)
            assert st.state == "up"  # a refusal, not an outage
            assert st.objects_written == 0 and st.dropped_writes.get("error", 0) > 0
            assert st.used_bytes <= capacity and not value_files(directory)
            l1_serves(src, dst, seed=50)
            assert src.client.ping()
        finally:
            src.close()
            dst.close()


def test_disk_that_cannot_keep_up_drops_writes_and_l1_serves(tmp_path: Path) -> None:
    """Stores far faster than the disk writes (a queue of 2 objects): the overflow is
    dropped and counted, L1 serves every store, and whatever did reach the disk is
    served from it byte for byte once L1 forgets it."""
    n = 8
    digests = chunk_digests(tokens(71, n), CHUNK)
    with disk_server(tmp_path / "disk", "--l2-write-queue-objects", "2") as a:
        src, dst = quick_workers(a.endpoint, seed=9)
        try:
            wait_for(lambda: disk_stats(src.client).state == "up", "disk tier up")
            ids = src.store(digests, block_seed=1)  # 16 objects into a queue of 2
            retrieve_exact(dst, src, ids, digests, n)
            wait_for(
                lambda: (
                    (st := disk_stats(src.client)).write_queue_objects == 0
                    and st.writes_in_flight == 0
                ),
                "queue drained",
            )
            st = disk_stats(src.client)
            assert st.dropped_writes.get("queue_full", 0) >= n
            assert st.objects_written + st.dropped_writes["queue_full"] == 2 * n
            assert st.state == "up" and not st.errors
            src.client.clear()
            # Whatever prefix the written objects make up (the queue takes objects in
            # store order, one object group after the other) is served exactly.
            hit = wait_for(
                lambda: (
                    (r := src.client.lookup(src.reg, digests, lease=False)).l2_pending_chunks == 0
                    and (r.hit_chunks,)
                ),
                "prefetch done",
            )[0]
            if hit:
                retrieve_exact(dst, src, ids, digests, hit)
            assert not disk_stats(src.client).invalid
        finally:
            src.close()
            dst.close()


@pytest.mark.needs_tool("redis-server", "Debian: redis-server; CI: .ci/install-redis.sh")
def test_hung_redis_below_the_disk_l1_and_disk_serve_on(tmp_path: Path) -> None:
    """The redis-server stopped (SIGSTOP: connections open, no replies, as a store that
    hangs): every L2 call times out and is counted; L1 and the disk serve meanwhile;
    after SIGCONT the tier comes back."""
    n = 3
    on_disk = chunk_digests(tokens(62, n), CHUNK)
    with RedisProcess() as r, disk_server(tmp_path / "disk", "--l2", r.url) as a:
        src, dst = quick_workers(a.endpoint, seed=13)
        assert r.proc is not None
        stopped = False
        try:
            wait_for(lambda: both_up(src.client), "both tiers up")
            ids = src.store(on_disk, block_seed=3)
            wait_for(lambda: written_to_both(src.client, 2 * n), "written to both")
            r.proc.send_signal(signal.SIGSTOP)
            stopped = True
            for i in range(3):
                l1_serves(src, dst, seed=120 + i)
            wait_for(
                lambda: (l2 := src.client.stats().l2) is not None and l2.state == "degraded",
                "L2 degraded (timed out)",
            )
            st = src.client.stats()
            assert st.l2 is not None and st.l2.errors.get("write", 0) >= 1
            src.client.clear()  # the disk alone has the first prefix now
            retrieve_exact(dst, src, ids, on_disk, n)
            l1_serves(src, dst, seed=130)
            assert disk_stats(src.client).state == "up" and src.client.ping()
            r.proc.send_signal(signal.SIGCONT)
            stopped = False
            wait_for(
                lambda: (l2 := src.client.stats().l2) is not None and l2.state == "up", "L2 back"
            )
            st = src.client.stats()
            assert st.l2 is not None and st.l2.hits == 0 and not st.l2.invalid
            assert not disk_stats(src.client).invalid
        finally:
            if stopped:
                r.proc.send_signal(signal.SIGCONT)
            src.close()
            dst.close()


def both_up(c: Client) -> bool:
    st = c.stats()
    return st.l2 is not None and st.l2.state == "up" and disk_stats(c).state == "up"


def written_to_both(c: Client, objects: int) -> bool:
    st = c.stats()
    return (
        st.l2 is not None
        and st.l2.objects_written >= objects
        and disk_stats(c).objects_written >= objects
    )


@pytest.mark.needs_tool("redis-server", "Debian: redis-server; CI: .ci/install-redis.sh")
def test_redis_gone_below_the_disk_l1_and_disk_serve_on(tmp_path: Path) -> None:
    n = 3
    on_disk = chunk_digests(tokens(61, n), CHUNK)
    with RedisProcess() as r, disk_server(tmp_path / "disk", "--l2", r.url) as a:
        src, dst = quick_workers(a.endpoint, seed=11)
        try:
            wait_for(lambda: both_up(src.client), "both tiers up")
            ids = src.store(on_disk, block_seed=3)
            wait_for(lambda: written_to_both(src.client, 2 * n), "written to both")
            r.kill()
            for i in range(3):
                l1_serves(src, dst, seed=20 + i)
            wait_for(
                lambda: (l2 := src.client.stats().l2) is not None and l2.state == "degraded",
                "L2 degraded",
            )
            for i in range(2):
                l1_serves(src, dst, seed=30 + i)
            st = src.client.stats()
            assert st.l2 is not None and sum(st.l2.dropped_writes.values()) > 0
            assert disk_stats(src.client).state == "up"
            src.client.clear()  # now only the disk has the first prefix
            retrieve_exact(dst, src, ids, on_disk, n)
            st = src.client.stats()
            assert st.l2 is not None and st.l2.hits == 0 and not st.l2.invalid
            assert disk_stats(src.client).hits >= 2 * n and not disk_stats(src.client).invalid
            assert src.client.ping()
        finally:
            src.close()
            dst.close()
