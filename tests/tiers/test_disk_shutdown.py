"""On SIGTERM the disk tier's write queue is written out: nothing committed is lost.

A real server stores a burst (more than the disk writes at once: 64 objects, 170 MB)
and gets SIGTERM right after the last store's reply; a server started on the same
directory hits every chunk of every prompt, byte for byte, and the first one's log
says the queue was written out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmc_server.client import chunk_digests
from lmc_server.testing.tierworker import (
    CHUNK,
    Worker,
    disk_server,
    disk_stats,
    lookup_until,
    retrieve_exact,
    tokens,
    value_files,
    wait_for,
)

PROMPTS = 8
CHUNKS = 4


def test_sigterm_right_after_a_burst_loses_nothing_committed(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    stored: list[tuple[bytes, dict[str, np.ndarray]]] = []
    with disk_server(directory, size_gb=1.0) as a:
        w = Worker(a.endpoint, seed=3)
        try:
            wait_for(lambda: disk_stats(w.client).state == "up", "disk tier up")
            for p in range(PROMPTS):
                d = chunk_digests(tokens(500 + p, CHUNKS), CHUNK)
                stored.append((d, w.store(d, block_seed=p)))
            st = disk_stats(w.client)
            pending = st.write_queue_objects + st.writes_in_flight
            assert a.terminate() == 0
        finally:
            w.close()
        log = a.log()
    assert "writing out" in log and "queue written out" in log, log
    assert "drain timeout" not in log
    assert pending > 0, "the burst was written before SIGTERM: nothing was tested"
    with disk_server(directory, size_gb=1.0) as b:
        r = Worker(b.endpoint, seed=0)
        src = Worker(b.endpoint, seed=3)  # the same pages as the first worker's
        try:
            for d, _ in stored:
                assert lookup_until(r.client, r.reg, d, CHUNKS).hit_chunks == CHUNKS
                r.client.release(r.client.lookup(r.reg, d).lease_id)
            for d, ids in stored[-2:]:
                r.client.clear()
                retrieve_exact(r, src, ids, d, CHUNKS)
            assert not disk_stats(r.client).invalid
        finally:
            r.close()
            src.close()


def test_kill_9_mid_writes_loses_only_writes_in_flight(tmp_path: Path) -> None:
    """kill -9 while the queue is full: after a restart no temporary file is left (the
    dead writer's go at start), the ledger is what is on disk, and every chunk is the
    exact bytes or a miss."""
    directory = tmp_path / "disk"
    stored: list[tuple[bytes, dict[str, np.ndarray]]] = []
    with disk_server(directory, size_gb=1.0) as a:
        w = Worker(a.endpoint, seed=4)
        try:
            wait_for(lambda: disk_stats(w.client).state == "up", "disk tier up")
            for p in range(PROMPTS):
                d = chunk_digests(tokens(900 + p, CHUNKS), CHUNK)
                stored.append((d, w.store(d, block_seed=p)))
            a.kill()
        finally:
            w.close()
    with disk_server(directory, size_gb=1.0) as b:
        r = Worker(b.endpoint, seed=0)
        src = Worker(b.endpoint, seed=4)
        try:
            wait_for(lambda: disk_stats(r.client).rebuild.done, "index rebuilt")
            assert not [p for p in directory.rglob("*.tmp")], "a temporary file is left"
            on_disk = sum(p.stat().st_size for p in value_files(directory))
            assert disk_stats(r.client).used_bytes == on_disk
            for d, ids in stored:
                r.client.clear()
                hit = lookup_until(r.client, r.reg, d, 0).hit_chunks
                r.client.release(r.client.lookup(r.reg, d).lease_id)
                if hit:
                    retrieve_exact(r, src, ids, d, hit)
            assert not disk_stats(r.client).invalid
        finally:
            r.close()
            src.close()
