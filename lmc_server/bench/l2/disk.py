"""``lmcache bench l2 --disk-dir DIR``: the disk tier through the server vs plain file I/O.

Two servers with ``--disk-dir`` on one directory (as several servers may share one): A
stores, B (empty L1) finds the objects on disk.

- write: a store of ``--chunks`` fresh chunks on A, timed until A's write-behind has
  written every object (so it includes the store into L1), against plain ``os.pwrite``
  of the same values (read back from A's files) into other files of the same directory;
  and the write-behind alone (from the store's reply, when its objects are committed
  and queued, until written), the disk tier's own share of that time;
- read: a lookup on B that misses L1, timed until every chunk is an L1 hit (prefetch:
  file reads, header and checksum checks, copies into L1, commit), against plain
  ``os.preadv`` of the same files;
- latency: the same for 1, 16 and 64 chunks (B's L1 cleared before each), median of
  ``--repeats``, against the plain reads of those files;
- flood: ``--flood-chunks`` fresh chunks stored on A back to back, as fast as the store
  into L1 goes (a store rate above the disk's), then again paced at
  ``PACED_FRACTION`` of the write-behind rate measured above (a rate the disk can
  carry): objects committed, written and dropped by cause once A's queue is empty;
- restart: the directory is filled to ``--restart-gb`` (A's objects plus filler files
  written plainly), both servers stop, a third starts on it: seconds from its first
  answer to ``ping`` until a lookup of A's prefix hits, and until its index is whole.

The plain side uses the same I/O as the tier: ``O_DIRECT`` where the filesystem takes
it (so neither side reads from the page cache), ``IO_THREADS`` threads, one whole file
per object. The last read is retrieved and compared byte for byte with what A stored.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import msgspec
import numpy as np

from lmc_server.bench.common import Report, format_table
from lmc_server.bench.l2.config import L2Config
from lmc_server.bench.l2.harness import TwoServers, random_digests
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.client import Client
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk.backend import IO_THREADS, LAYOUT_DIR

#: The paced flood stores at this fraction of the write-behind rate of the rounds.
PACED_FRACTION = 0.8
#: Chunks per store of the flood (one prompt of a few chunks, as an engine stores).
FLOOD_STORE_CHUNKS = 4


class _Plain:
    """Plain whole-file I/O on the same filesystem, as the tier does it."""

    def __init__(self, directory: str, direct: bool) -> None:
        self.dir = os.path.join(directory, "bench-plain")
        os.makedirs(self.dir, exist_ok=True)
        self.direct = direct
        self.pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="bench-plain")

    def _write_one(self, path: str, value: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o640)
        try:
            out = memoryview(value.obj)[: direct_io.padded(len(value))] if self.direct else value
            done = 0
            while done < len(out):
                done += os.pwrite(fd, out[done:], done)
            if len(out) != len(value):
                os.ftruncate(fd, len(value))
        finally:
            os.close(fd)

    def _read_one(self, path: str, size: int) -> int:
        buf = direct_io.aligned_buffer(size)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            want = direct_io.padded(size) if self.direct else size
            done = 0
            while done < size:
                got = os.preadv(fd, [memoryview(buf)[done:want]], done)
                if not got:
                    break
                done += got
            return done
        finally:
            os.close(fd)

    def write(self, values: list[memoryview], tag: str) -> tuple[float, list[str]]:
        paths = [os.path.join(self.dir, f"{tag}-{i}") for i in range(len(values))]
        t0 = time.perf_counter()
        list(self.pool.map(self._write_one, paths, values))
        return time.perf_counter() - t0, paths

    def read(self, paths: list[str]) -> float:
        sizes = [os.path.getsize(p) for p in paths]
        t0 = time.perf_counter()
        list(self.pool.map(self._read_one, paths, sizes))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()


class _Setup(TwoServers):
    def __init__(self, cfg: L2Config, stack: ExitStack) -> None:
        probe = cfg.geometry.build(1)
        chunk_bytes = sum(  # at most: every page of every cached group, plus headers
            blocks_per_chunk(g, cfg.chunk_size) * sum(lay.page_bytes for lay in g.layers) + 8192
            for g in probe.groups
            if g.cached
        )
        # Room for every round, latency point and flood, so none evicts another's files.
        held = chunk_bytes * (
            cfg.rounds * cfg.chunks + sum(cfg.latency_chunks) + 2 * cfg.flood_chunks
        )
        size_gb = max(4.0, 2 * cfg.restart_gb) + round(held / (1 << 30), 2)
        args = ["--disk-dir", cfg.disk_dir, "--disk-size-gb", str(size_gb)]
        super().__init__(cfg, stack, "disk", args)
        self.direct = self.stats(self.ca).direct_io
        self.plain = _Plain(cfg.disk_dir, self.direct)
        stack.callback(self.plain.close)

    def files(self, digests: bytes) -> list[str]:
        return [
            os.path.join(self.cfg.disk_dir, LAYOUT_DIR, space.hex(), ck[:2], ck)
            for space in self.spaces()
            for ck in (digests[i : i + 32].hex() for i in range(0, len(digests), 32))
        ]

    def plain_write(self, paths: list[str], rnd: int) -> tuple[float, list[str]]:
        """A's files written again plainly: (seconds, the plain files)."""
        return self.plain.write(_values(paths), f"r{rnd}")

    def flood(self, first_seed: int, chunks: int, gbps: float = 0.0) -> dict:
        """Store ``chunks`` fresh chunks on A, ``FLOOD_STORE_CHUNKS`` per store, back to
        back (``gbps`` 0) or paced at ``gbps``; once A's queue is empty, what of it was
        written and what dropped, by cause (differences of A's counters)."""
        before = self.stats(self.ca)
        obj_bytes = sum(og.object_bytes for og in self.rega.object_groups)
        committed = 0
        t0 = time.perf_counter()
        per = min(FLOOD_STORE_CHUNKS, self.max_chunks)  # what the KV cache has blocks for
        for i in range(0, chunks, per):
            n = min(per, chunks - i)
            d = random_digests(first_seed + i, n, self.rega.chunk_size)
            ids = block_ids_for(self.rega, n, np.random.default_rng(first_seed + i))
            res = self.ca.store(self.rega, d, ids)
            committed += sum(int((s == 0).sum()) for s in res.statuses.values())
            if gbps:
                due = t0 + (i + n) * obj_bytes / (gbps * 1e9)
                time.sleep(max(0.0, due - time.perf_counter()))
        t_store = time.perf_counter() - t0
        self.wait(lambda: self.written(self.ca) >= 0, "write-behind", 600)
        t_all = time.perf_counter() - t0
        after = self.stats(self.ca)
        written = after.objects_written - before.objects_written
        dropped = {
            k: v - before.dropped_writes.get(k, 0)
            for k, v in after.dropped_writes.items()
            if v - before.dropped_writes.get(k, 0)
        }
        return {
            "chunks": chunks,
            "store_gbps_target": gbps or None,
            "store_gbps": chunks * obj_bytes / t_store / 1e9,
            "committed_objects": committed,
            "written_objects": written,
            "written_fraction": written / committed if committed else 0.0,
            "dropped_writes": dropped,
            "write_gbps": (after.bytes_written - before.bytes_written) / t_all / 1e9,
            "store_s": t_store,
            "until_written_s": t_all,
        }


def _values(paths: list[str]) -> list[memoryview]:
    out = []
    for p in paths:
        v = direct_io.read_file(p, False, 1 << 30)
        if v is None:
            raise RuntimeError(f"an object A wrote is missing: {p}")
        out.append(v)
    return out


def _restart(s: _Setup, stack: ExitStack, digests: bytes, n: int) -> dict:
    """Fill to ``restart_gb``, stop both servers, time a third's first hit and index."""
    cfg = s.cfg
    sample = _values(s.files(digests)[:1])[0]
    filler_dir = os.path.join(cfg.disk_dir, LAYOUT_DIR, uuid.uuid4().hex)
    used = s.stats(s.ca).used_bytes
    fill_files = max(0, int((cfg.restart_gb * (1 << 30) - used) // len(sample)))
    for i in range(fill_files):  # plain files of the layout (never looked up here)
        sub = os.path.join(filler_dir, f"{i % 256:02x}")
        os.makedirs(sub, exist_ok=True)
        name = f"{i % 256:02x}" + (uuid.uuid4().hex + uuid.uuid4().hex)[:62]
        s.plain._write_one(os.path.join(sub, name), sample)
    s.ca.close()
    s.cb.close()
    s.a.terminate()
    s.b.terminate()
    t0 = time.perf_counter()
    third = stack.enter_context(ServerProcess(s.args, l1_size_gb=cfg.l1_size_gb))
    t_ping = time.perf_counter() - t0
    cc = stack.enter_context(Client(third.endpoint, timeout_s=60))
    reg = cc.register(**s.dst.register_kwargs())
    t1 = time.perf_counter()
    t_first = 0.0

    def all_hit() -> bool:
        nonlocal t_first
        hit = cc.lookup(reg, digests, lease=False).hit_chunks
        if 0 < hit < n and not t_first:
            t_first = time.perf_counter() - t1
        return hit >= n

    s.wait(all_hit, f"{n} chunks hit after the restart", 600)
    t_all = time.perf_counter() - t1
    s.wait(lambda: s.stats(cc).rebuild.done, "index rebuild", 600)
    st = s.stats(cc)
    return {
        "restart_gb": round(st.used_bytes / (1 << 30), 2),
        "files": st.files,
        "start_to_ping_s": t_ping,
        "ping_to_first_hit_s": t_first or t_all,
        f"ping_to_{n}_chunk_hit_s": t_all,
        "index_rebuild_s": st.rebuild.seconds,
    }


def run(cfg: L2Config) -> Report:
    report = Report(
        "l2-disk",
        {
            "chunks": cfg.chunks,
            "rounds": cfg.rounds,
            "latency_chunks": list(cfg.latency_chunks),
            "repeats": cfg.repeats,
            "restart_gb": cfg.restart_gb,
            "geometry": cfg.geometry.describe(),
            "chunk_size": cfg.chunk_size,
            "l1_size_gb": cfg.l1_size_gb,
            "disk_dir": cfg.disk_dir,
            "io_threads": IO_THREADS,
            "flood_chunks": cfg.flood_chunks,
        },
    )
    with ExitStack() as stack:
        s = _Setup(cfg, stack)
        report.config["direct_io"] = s.direct
        report.config["chunk_bytes"] = s.obj_bytes
        digests, w_store, w_srv = s.measure(report, s.files, s.plain_write, s.plain.read, True)
        report.summary["disk_b"] = msgspec.to_builtins(s.stats(s.cb))
        flood: dict = {}
        if cfg.flood_chunks:
            behind_s = statistics.median([a - b for a, b in zip(w_srv, w_store, strict=True)])
            behind_gbps = cfg.chunks * s.obj_bytes / behind_s / 1e9
            flood = {
                "back_to_back": s.flood(20_000, cfg.flood_chunks),
                "paced": s.flood(40_000, cfg.flood_chunks, PACED_FRACTION * behind_gbps),
            }
        report.summary["flood"] = flood
        report.summary["restart"] = _restart(s, stack, digests, cfg.chunks)
    report.notes.append(
        "ratio = plain time / server time (1.0: as fast as plain os.pwrite/os.preadv of "
        "the same bytes on the same filesystem; target >= 0.8 for 64-chunk throughput)"
    )
    report.notes.append(
        f"one chunk = {report.config['chunk_bytes']} bytes (all its "
        f"objects); write includes the store into L1, write-behind starts at "
        f"the store's reply (the commit); read = lookup miss "
        f"until every chunk is an L1 hit; direct I/O: {s.direct}"
    )
    return report


def table(report: Report) -> str:
    rows = format_table(
        report.rows,
        (
            "op|operation; server_s|server s|.4f; store_s|of which store s|.4f; "
            "raw_s|plain s|.4f; server_gbps|server GB/s|.2f; raw_gbps|plain GB/s|.2f; "
            "ratio|plain/server|.2f"
        ),
    )
    flood = "".join(
        f"\nflood {name} ({f['chunks']} chunks, stores at {f['store_gbps']:.2f} GB/s): "
        f"{f['written_objects']} of {f['committed_objects']} committed objects written "
        f"({f['written_fraction']:.3f}), dropped {f['dropped_writes'] or 'none'}, "
        f"disk {f['write_gbps']:.2f} GB/s"
        for name, f in report.summary.get("flood", {}).items()
    )
    r = report.summary.get("restart", {})
    return (
        rows
        + flood
        + (
            f"\nrestart on {r.get('restart_gb')} GiB ({r.get('files')} files): "
            f"ping after {r.get('start_to_ping_s', 0):.2f} s, first hit "
            f"{r.get('ping_to_first_hit_s', 0):.3f} s after ping, index whole "
            f"{r.get('index_rebuild_s', 0):.2f} s after start\n"
            if r
            else ""
        )
    )
