"""The disk tier end to end: real server processes on a tmp_path directory, real bytes.

What is checked: a server restarted on a directory an earlier one filled serves those
objects (SIGTERM and kill -9 mid-write), byte for byte; a damaged, truncated or foreign
file is a counted miss, removed, never served; the capacity holds; a directory that
goes away degrades the tier and L1 serves on; with Redis too, the order is L1 -> disk ->
L2 and an L2 hit is promoted to the disk.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server.client import Client, chunk_digests
from lmc_server.testing.process import free_port
from lmc_server.testing.redis_process import RedisProcess
from lmc_server.testing.tierworker import (
    CHUNK,
    Worker,
    disk_server,
    disk_stats,
    lookup_until,
    retrieve_exact,
    tokens,
    value_files,
    wait_disk_written,
    wait_for,
)
from lmc_server.tiers import codec


def objects_of(w: Worker, digests: bytes, ids: dict[str, np.ndarray]) -> int:
    return sum(int(s.size) for s in w.client.store(w.reg, digests, ids).statuses.values())


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[Path, Worker, bytes, dict[str, np.ndarray]]]:
    """A directory one server filled with 6 chunks and left (SIGTERM); the worker that
    stored them keeps its KV to compare with."""
    n = 6
    digests = chunk_digests(tokens(61, n), CHUNK)
    with disk_server(tmp_path) as a:
        w = Worker(a.endpoint, seed=17)
        wait_for(lambda: disk_stats(w.client).state == "up", "disk tier up")
        ids = w.store(digests, block_seed=3)
        wait_disk_written(w.client, objects_of(w, digests, ids))
        w.client.close()
        assert a.terminate() == 0
    try:
        yield tmp_path, w, digests, ids
    finally:
        w.kv.close()


# -- warm restart ----------------------------------------------------------------------


def test_restart_after_sigterm_serves_the_directory_byte_exact(
    stored: tuple[Path, Worker, bytes, dict[str, np.ndarray]],
) -> None:
    directory, src, digests, ids = stored
    metrics = free_port()
    with disk_server(directory, metrics_port=metrics) as b:
        wb = Worker(b.endpoint, seed=0)
        try:
            wait_for(lambda: disk_stats(wb.client).state == "up", "disk tier up")
            retrieve_exact(wb, src, ids, digests, 6)
            st = disk_stats(wb.client)
            assert st.hits >= 6 and not st.invalid and st.objects_written == 0
            wait_for(lambda: disk_stats(wb.client).rebuild.done, "the index rebuilt")
            st = disk_stats(wb.client)
            assert st.rebuild.files == len(value_files(directory)) == 12
            assert st.files == 12 and st.used_bytes == sum(
                p.stat().st_size for p in value_files(directory)
            )
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/healthz") as h:
                assert h.status == 200 and b"disk file://" in h.read()
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics") as h:
                body = h.read()
            assert b"lmcache_disk_up 1.0" in body and b"lmcache_disk_hits_total" in body
            assert b"lmcache_disk_index_rebuild_ratio 1.0" in body
            out = subprocess.run(
                [sys.executable, "-m", "lmc_server", "stats", "--port", str(b.port)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0 and f"disk file://{directory} up" in out.stdout
            assert "12 files, index whole" in out.stdout
        finally:
            wb.close()


def test_kill_9_mid_write_never_serves_a_half_written_object(tmp_path: Path) -> None:
    rounds, n = 4, 12
    prefixes = [chunk_digests(tokens(70 + i, n), CHUNK) for i in range(rounds)]
    a = disk_server(tmp_path).start()
    src = Worker(a.endpoint, seed=23, num_blocks=8 * n)
    try:
        wait_for(lambda: disk_stats(src.client).state == "up", "disk tier up")
        all_ids = [src.store(d, block_seed=i) for i, d in enumerate(prefixes)]
        victim = _full_file(tmp_path, src.client, src.reg.namespace, prefixes[-1], n - 1)
        a.kill()  # SIGKILL while the write-behind is still writing
        src.client.close()
        # What a writer killed inside a file leaves: a temporary file, half written (aged
        # past the rebuild's staleness bound), beside where its value would have gone.
        victim.parent.mkdir(parents=True, exist_ok=True)
        half = victim.parent / f".{victim.name}.host.1.0.tmp"
        half.write_bytes(b"LMC2" + bytes(1000))
        os.utime(half, (1.0, 1.0))
        victim.unlink(missing_ok=True)
        with disk_server(tmp_path) as b:
            wb = Worker(b.endpoint, seed=0, num_blocks=8 * n)
            try:
                wait_for(lambda: disk_stats(wb.client).state == "up", "disk tier up")
                for d, ids in zip(prefixes, all_ids, strict=True):
                    hit = lookup_until(wb.client, wb.reg, d, 0)
                    wb.client.release(hit.lease_id)
                    if hit.hit_chunks:
                        retrieve_exact(wb, src, ids, d, hit.hit_chunks)
                st = disk_stats(wb.client)
                assert not st.invalid
                wait_for(lambda: disk_stats(wb.client).rebuild.done, "the index rebuilt")
                assert disk_stats(wb.client).rebuild.stale_tmp_removed >= 1
                assert not half.exists()
            finally:
                wb.close()
    finally:
        a.kill()
        src.kv.close()


# -- damaged files -----------------------------------------------------------------------


def _full_file(directory: Path, c: Client, namespace: str, digests: bytes, chunk: int) -> Path:
    fps = {p.name: bytes.fromhex(p.fingerprint) for p in c.stats().partitions}
    space = codec.space_of(namespace, fps["full"], CHUNK)
    ck = digests[chunk * 32 : (chunk + 1) * 32].hex()
    return directory / "lmc2" / space.hex() / ck[:2] / ck


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("flip_byte", "checksum"),
        ("truncate", "truncated"),
        ("other_chunk", "foreign"),
        ("empty", "truncated"),
    ],
)
def test_damaged_file_is_a_counted_miss_and_removed(
    stored: tuple[Path, Worker, bytes, dict[str, np.ndarray]], damage: str, reason: str
) -> None:
    directory, src, digests, ids = stored
    with disk_server(directory) as b:
        wb = Worker(b.endpoint, seed=0)
        try:
            bad = _full_file(directory, wb.client, wb.reg.namespace, digests, 3)
            data = bad.read_bytes()
            if damage == "flip_byte":
                i = codec.HEADER_BYTES + len(data) // 3
                bad.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :])
            elif damage == "truncate":
                bad.write_bytes(data[: len(data) // 2])
            elif damage == "other_chunk":
                shutil.copyfile(_full_file(directory, wb.client, wb.reg.namespace, digests, 4), bad)
            else:
                bad.write_bytes(b"")
            wait_for(lambda: disk_stats(wb.client).state == "up", "disk tier up")
            look = lookup_until(wb.client, wb.reg, digests, 3)
            assert look.hit_chunks == 3  # stops before the damaged chunk
            wb.client.release(look.lease_id)
            st = disk_stats(wb.client)
            assert st.invalid == {reason: 1}
            wait_for(lambda: not bad.exists(), "the damaged file removed")
            retrieve_exact(wb, src, ids, digests, 3)
            # The server still serves others, and writes a sound file in its place.
            fresh = chunk_digests(tokens(99, 2), CHUNK)
            wb.store(fresh, block_seed=4)
            assert wb.client.lookup(wb.reg, fresh, lease=False).hit_chunks == 2
        finally:
            wb.close()


# -- capacity and failure --------------------------------------------------------------


def test_capacity_holds_and_the_oldest_files_go(tmp_path: Path) -> None:
    cap_gb = 0.03  # about 6 chunks of the preset
    with disk_server(tmp_path, size_gb=cap_gb) as a:
        w = Worker(a.endpoint, seed=31)
        try:
            wait_for(lambda: disk_stats(w.client).state == "up", "disk tier up")
            written = 0
            for i in range(4):
                d = chunk_digests(tokens(80 + i, 4), CHUNK)
                ids = w.store(d, block_seed=i)
                written += objects_of(w, d, ids)
                wait_disk_written(w.client, written)
            st = disk_stats(w.client)
            on_disk = sum(p.stat().st_size for p in value_files(tmp_path))
            assert st.used_bytes == on_disk <= st.capacity_bytes == int(cap_gb * (1 << 30))
            assert st.evicted_objects > 0 and st.files == len(value_files(tmp_path))
            first = _full_file(
                tmp_path, w.client, w.reg.namespace, chunk_digests(tokens(80, 4), CHUNK), 0
            )
            last = _full_file(
                tmp_path, w.client, w.reg.namespace, chunk_digests(tokens(83, 4), CHUNK), 3
            )
            assert not first.exists() and last.exists()
        finally:
            w.close()


def test_directory_gone_degrades_the_tier_and_l1_serves_on(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    with disk_server(directory) as a:
        w = Worker(a.endpoint, seed=41)
        try:
            wait_for(lambda: disk_stats(w.client).state == "up", "disk tier up")
            shutil.rmtree(directory)
            directory.write_bytes(b"not a directory")
            for i in range(3):
                d = chunk_digests(tokens(90 + i, 2), CHUNK)
                w.store(d, block_seed=i)
                assert w.client.lookup(w.reg, d, lease=False).hit_chunks == 2
            wait_for(lambda: disk_stats(w.client).state == "degraded", "degraded")
            assert "disk" in a.log() and "degraded" in a.log()
            os.unlink(directory)
            wait_for(lambda: disk_stats(w.client).state == "up", "up again", 20)
            before = disk_stats(w.client).objects_written
            w.store(chunk_digests(tokens(95, 2), CHUNK), block_seed=9)
            wait_for(lambda: disk_stats(w.client).objects_written > before, "writes again")
        finally:
            w.close()


# -- with an L2 store below ------------------------------------------------------------


@pytest.mark.needs_tool("redis-server", "Debian: redis-server; CI: .ci/install-redis.sh")
def test_l2_hit_is_promoted_to_the_disk_then_served_from_it(tmp_path: Path) -> None:
    n = 5
    digests = chunk_digests(tokens(101, n), CHUNK)
    with RedisProcess() as r:
        l2 = ["--l2", r.url]
        with disk_server(tmp_path / "a", *l2) as a:
            wa = Worker(a.endpoint, seed=51)
            try:
                wait_for(
                    lambda: (wa.client.stats().l2 or disk_stats(wa.client)).state == "up", "L2 up"
                )
                ids = wa.store(digests, block_seed=5)
                objects = objects_of(wa, digests, ids)
                wait_for(
                    lambda: (
                        (l2 := wa.client.stats().l2) is not None and l2.objects_written >= objects
                    ),
                    "written to L2",
                )
                with disk_server(tmp_path / "b", *l2) as b:
                    wb = Worker(b.endpoint, seed=0)
                    try:
                        wait_for(
                            lambda: (wb.client.stats().l2 or disk_stats(wb.client)).state == "up",
                            "B's L2 up",
                        )
                        retrieve_exact(wb, wa, ids, digests, n)
                        st = wb.client.stats()
                        assert st.l2 is not None and st.l2.hits >= n
                        wait_disk_written(wb.client, objects)  # promoted from L2
                        assert st.l2.objects_written == 0  # nothing written back to L2
                    finally:
                        wb.close()
                with disk_server(tmp_path / "b") as c:  # B's disk alone, no L2
                    wc = Worker(c.endpoint, seed=0)
                    try:
                        retrieve_exact(wc, wa, ids, digests, n)
                        assert disk_stats(wc.client).hits >= n
                    finally:
                        wc.close()
            finally:
                wa.close()
