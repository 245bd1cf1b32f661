"""``lmcache bench ranks``: tensor-parallel ranks with replicated KV against one server.

The target deployment is one server shared by eight worker processes, one per GPU,
each registering the same DeepSeek-V4.1-Flash-shaped KV cache as rank ``r`` of
``world_size`` with replicated KV (MLA: every rank holds identical bytes). This
benchmark runs exactly that with real processes: one ``lmcache server`` and one worker
subprocess per rank (round-robin over the visible GPUs for ``cuda``, POSIX shared
memory for ``cpu``). Every worker fills its KV with the same seeded random bytes, so
any rank can check bytes another rank stored. The parent talks to workers through JSON
lines on their stdin/stdout (no pickle anywhere).

Phase 1: rank 0 stores ``chunks`` chunks from region A; every other rank stores the
same chunks (all must be ``EXISTS``: replicated KV is stored once, L1 used bytes equal
one copy); every rank retrieves every chunk into region B (single-chunk requests, so
every stored byte, window sections included, is written) and compares every byte.

Raw baseline: every GPU at once (one process per GPU) runs pinned ``cudaMemcpy`` per
direction (``testing.cuda_kv.raw_copy_gbps``); on cpu every rank process runs numpy
copies at once. The aggregate is the sum.

TP phases (``tp_modes``, each for ``tp_s``), the steady-state transfer throughput with
no byte check inside the timed loop: ``load`` is the tensor-parallel load pattern, every
rank retrieving the same prefix of ``tp_chunks`` phase-1 chunks into its own GPU at
once (``tp_inflight`` requests in flight each, 1 = a rank waits for its load before the
next, as before a prefill); ``mixed`` adds rank 0 storing fresh chunks meanwhile. Per
rank and aggregate GB/s per direction against the raw aggregate; after each loop, one
poisoned retrieve per rank is compared byte for byte.

Phase 2 (a correctness soak; its GB/s include the byte checks it makes): for
``duration_s`` every rank runs a store loop (fresh chunks, the same
sequence on every rank: the first to store a chunk copies, the others get ``EXISTS`` or
``IN_PROGRESS``) and a retrieve loop (chunks it saw committed, into other blocks of
region B; every ``verify_every``-th retrieve is poisoned first and compared byte for
byte) on one connection. Bytes copied = OK statuses x object bytes; aggregate GB/s per
direction = bytes of all ranks / phase seconds. L1: the server's stored bytes must be
the distinct chunks stored, once (up to what eviction or a killed rank's unfinished
writes make unknowable, reported separately).

Phase 3 (``kill_one``): halfway through phase 2 the last rank gets SIGKILL; the other
ranks must finish with no error, and within ``KILL_DETECT_S`` the server's
registrations drop by one (on cpu, its maps of the victim's segments are gone too).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import IO, Any

import numpy as np

from lmc_server.bench.common import GeometryArgs, Report, format_table
from lmc_server.cache.layout import build_layout
from lmc_server.client.shm import SHM_DIR
from lmc_server.client.sync import Client
from lmc_server.testing.presets import KVGeometry
from lmc_server.testing.process import ServerProcess

log = logging.getLogger(__name__)

CHUNK_SIZE = 256
REGION_A, REGION_B = 0, 1
KILL_DETECT_S = 5.0
POOL_READY_TIMEOUT_S = 600.0
MAX_ERRORS_KEPT = 5
#: Raw copies are at least this large, so that a small geometry is not timed in cache.
RAW_MIN_BYTES = 64 << 20
#: Phase 2 stores a chunk again while another rank is writing it, so that every chunk
#: ends committed or failed (exact single-copy accounting), this often, this long.
IN_PROGRESS_POLL_S = 0.002
IN_PROGRESS_RETRY_S = 2.0


@dataclass(frozen=True)
class RanksConfig:
    backend: str = "cpu"
    ranks: int = 8
    chunks: int = 1000
    duration_s: float = 60.0
    kill_one: bool = True
    geometry: GeometryArgs = GeometryArgs()
    num_blocks: int | None = None
    batch: int = 16
    l1_size_gb: float | None = None
    verify_every: int = 8
    raw_s: float = 1.0
    seed: int = 0
    tp_modes: tuple[str, ...] = ("load", "mixed")
    tp_s: float = 5.0
    tp_chunks: int | None = None
    tp_inflight: int = 1


def blocks_needed(geometry: KVGeometry, chunks: int) -> int:
    """Blocks per group for regions A and B of ``chunks`` chunk slots each."""
    return 2 * chunks * max(CHUNK_SIZE // g.tokens_per_block
                            for g in geometry.groups if g.cached)


def digests(seed: int, phase: str, indices: Sequence[int] | np.ndarray) -> bytes:
    """32-byte keys of chunk ``indices`` of a phase; the same on every rank."""
    return b"".join(hashlib.blake2b(f"{seed}:{phase}:{int(i)}".encode(), digest_size=32
                                    ).digest() for i in indices)


def auto_l1_size_gb(chunk_bytes: int, chunks: int) -> float:
    """Room for phase 1 twice over plus 1 GiB, so phase 1 never evicts."""
    return round(-(-(2 * chunks * chunk_bytes + (1 << 30)) // (1 << 28)) / 4, 2)


# -- worker side --------------------------------------------------------------------------


class _Rank:
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


def _gather(ranks: Sequence[_Rank], cmd: dict[str, Any], timeout_s: float
            ) -> list[dict[str, Any]]:
    """Send ``cmd`` to every rank first, then collect the replies (they run at once)."""
    for r in ranks:
        r.send(cmd)
    return [r.recv(timeout_s) for r in ranks]


def _maps_hold(pid: int, names: Sequence[str]) -> bool | None:
    """Whether process ``pid`` still maps any of the shm segments ``names``."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return any(n in maps for n in names)


def _union_bits(replies: Sequence[dict[str, Any]], key: str, og: str) -> np.ndarray:
    n = max((r["stored_chunks"] for r in replies), default=0)
    out = np.zeros(n, dtype=bool)
    for r in replies:
        bits = np.unpackbits(np.frombuffer(base64.b64decode(r[key][og]), dtype=np.uint8))
        bits = bits[:r["stored_chunks"]].astype(bool)
        out[:bits.size] |= bits
    return out


class _Run:
    """State of one benchmark run; methods are the phases, in order."""

    def __init__(self, cfg: RanksConfig, report: Report, srv: ServerProcess,
                 admin: Client) -> None:
        self.cfg, self.report, self.srv, self.admin = cfg, report, srv, admin
        self.ranks: list[_Rank] = []
        self.s: dict[str, Any] = report.summary
        self.checks: dict[str, bool] = {}
        self.chunk_bytes = 0
        self.object_bytes: dict[str, int] = {}

    def start_ranks(self, num_blocks: int) -> None:
        cfg = self.cfg
        base = {"endpoint": self.srv.endpoint, "backend": cfg.backend, "ranks": cfg.ranks,
                "chunks": cfg.chunks, "batch": cfg.batch, "seed": cfg.seed,
                "geometry": asdict(cfg.geometry), "num_blocks": num_blocks}
        for rank in range(cfg.ranks):
            self.ranks.append(_Rank(rank, {**base, "rank": rank}))
        for r in self.ranks:
            r.info = r.recv(POOL_READY_TIMEOUT_S)
        info = self.ranks[0].info
        self.chunk_bytes, self.object_bytes = info["chunk_bytes"], info["object_bytes"]
        assert len({r.info["namespace"] for r in self.ranks}) == 1, "one replicated namespace"
        self.report.config.update(chunk_bytes=self.chunk_bytes, arch=info["arch"],
                                  namespace=info["namespace"],
                                  devices=[r.info["device"] for r in self.ranks])
        self.checks["all ranks registered"] = (self.admin.stats().registrations
                                               == cfg.ranks)

    def phase1(self) -> None:
        cfg, n_og = self.cfg, len(self.object_bytes)
        one_copy = cfg.chunks * self.chunk_bytes
        s0 = self.admin.stats()
        first = self.ranks[0].call({"cmd": "p1_store"}, 3600)
        s1 = self.admin.stats()
        rest = _gather(self.ranks[1:], {"cmd": "p1_store"}, 3600)
        s2 = self.admin.stats()
        got = _gather(self.ranks, {"cmd": "p1_retrieve"}, 3600)
        p1 = {"store_rank0": first, "store_others_exists": [r["status"]["exists"] for r in rest],
              "one_copy_bytes": one_copy, "l1_used_after_rank0": s1.l1.used_bytes,
              "l1_used_after_all": s2.l1.used_bytes,
              "stored_bytes_rank0": s1.counters.stored_bytes - s0.counters.stored_bytes,
              "stored_bytes_others": s2.counters.stored_bytes - s1.counters.stored_bytes,
              "mismatched_bytes": sum(r["mismatched_bytes"] for r in got),
              "checked_bytes": sum(r["checked_bytes"] for r in got),
              "retrieve_errors": sum(r["errors"] + r["status"]["miss"] + r["status"]["failed"]
                                     for r in got),
              "retrieve_s": max(r["seconds"] for r in got)}
        self.s["phase1"] = p1
        for r, g in zip(self.ranks, got, strict=True):
            self.report.rows.append({"rank": r.rank, "pid": r.info["pid"],
                                     "device": r.info["device"],
                                     "p1_checked_bytes": g["checked_bytes"],
                                     "p1_mismatched_bytes": g["mismatched_bytes"]})
        self.checks.update({
            "p1 rank 0 stored every chunk once": (
                first["status"]["ok"] == cfg.chunks * n_og and first["errors"] == 0
                and p1["stored_bytes_rank0"] == one_copy),
            "p1 other ranks: every chunk EXISTS": all(
                r["status"]["exists"] == cfg.chunks * n_og and r["status"]["ok"] == 0
                and r["errors"] == 0 for r in rest) and p1["stored_bytes_others"] == 0,
            "p1 L1 used == one copy": s1.l1.used_bytes == s2.l1.used_bytes
            == one_copy,
            "p1 every byte on every rank": p1["mismatched_bytes"] == 0
            and p1["retrieve_errors"] == 0
            and p1["checked_bytes"] == cfg.ranks * one_copy,
        })

    def raw(self) -> None:
        cfg = self.cfg
        if cfg.backend == "cuda":
            first_on: dict[int, _Rank] = {}
            for r in self.ranks:
                first_on.setdefault(r.info["device"], r)
            part = list(first_on.values())
        else:
            part = list(self.ranks)
        nbytes = max(cfg.batch * self.chunk_bytes, RAW_MIN_BYTES)
        _gather(part, {"cmd": "raw_prepare", "nbytes": nbytes, "raw_s": cfg.raw_s}, 600)
        raw: dict[str, Any] = {"processes": len(part), "bytes_per_copy": nbytes}
        for d in ("d2h", "h2d"):
            per = [g["gbps"] for g in _gather(part, {"cmd": "raw_go", "direction": d,
                                                     "raw_s": cfg.raw_s}, 600)]
            raw[f"{d}_gbps"] = sum(per)
            raw[f"{d}_gbps_per_process"] = per
        self.s["raw"] = raw

    def tp(self, mode: str) -> None:
        """One TP phase (module docstring): aggregate and per-rank GB/s, byte check."""
        cfg = self.cfg
        n = min(cfg.tp_chunks or cfg.batch, cfg.chunks)
        got = _gather(self.ranks, {"cmd": "tp", "mode": mode, "duration_s": cfg.tp_s,
                                   "chunks": n, "inflight": cfg.tp_inflight},
                      cfg.tp_s + 600)
        seconds = max(g["seconds"] for g in got)
        raw = self.s["raw"]
        res: dict[str, Any] = {"chunks": n, "inflight": cfg.tp_inflight, "seconds": seconds}
        for d, key in (("retrieve", "h2d_gbps"), ("store", "d2h_gbps")):
            nbytes = sum(g[d]["copied_bytes"] for g in got)
            requests = sum(g[d]["requests"] for g in got)
            res[f"{d}_gbps"] = nbytes / seconds / 1e9
            res[f"{d}_ratio"] = res[f"{d}_gbps"] / raw[key] if raw[key] else None
            res[f"{d}_requests"] = requests
            res[f"{d}_ms_per_request"] = (1e3 * sum(g[d]["busy_s"] for g in got) / requests
                                          if requests else None)
            res[f"{d}_gbps_per_rank"] = [g[d]["copied_bytes"] / g["seconds"] / 1e9
                                         for g in got]
        res["errors"] = sum(g[d]["errors"] for g in got for d in ("retrieve", "store"))
        res["failed_statuses"] = sum(g["retrieve"]["status"][s] for g in got
                                     for s in ("miss", "failed"))
        res["mismatched_bytes"] = sum(g["mismatched_bytes"] for g in got)
        res["checked_bytes"] = sum(g["checked_bytes"] for g in got)
        self.s[f"tp_{mode}"] = res
        for row, g in zip(self.report.rows, got, strict=True):
            row[f"tp_{mode}_retrieve_gbps"] = g["retrieve"]["copied_bytes"] / g["seconds"] / 1e9
        self.checks[f"tp {mode}: no errors, every byte checked"] = (
            res["errors"] == 0 and res["failed_statuses"] == 0 and res["mismatched_bytes"] == 0
            and res["checked_bytes"] > 0 and all(g["verify_ok"] for g in got)
            and res["retrieve_requests"] > 0)

    def phase2(self) -> None:
        cfg = self.cfg
        s0 = self.admin.stats()
        victim = self.ranks[-1] if cfg.kill_one and cfg.ranks > 1 else None
        for r in self.ranks:
            r.send({"cmd": "p2", "duration_s": cfg.duration_s,
                    "verify_every": cfg.verify_every})
        t0 = time.monotonic()
        if victim is not None:
            time.sleep(cfg.duration_s / 2)
            self.phase3(victim)
        survivors = [r for r in self.ranks if r is not victim]
        got = [r.recv(cfg.duration_s + 600) for r in survivors]
        wall_s = time.monotonic() - t0
        s1 = self.admin.stats()
        seconds = max(g["seconds"] for g in got)
        store_b = sum(g["store"]["copied_bytes"] for g in got)
        ret_b = sum(g["retrieve"]["copied_bytes"] for g in got)
        raw = self.s["raw"]
        distinct = {og: _union_bits(got, "committed_bits", og) for og in self.object_bytes}
        pending = {og: _union_bits(got, "pending_bits", og) & ~distinct[og]
                   for og in self.object_bytes}
        distinct_b = sum(int(distinct[og].sum()) * b for og, b in self.object_bytes.items())
        unknown_b = sum(int(pending[og].sum()) * b for og, b in self.object_bytes.items())
        copies_b = s1.counters.stored_bytes - s0.counters.stored_bytes
        evicted_b = s1.counters.evicted_bytes - s0.counters.evicted_bytes
        evicted_total = int(s1.counters.evicted_bytes)
        stored_total = int(s1.counters.stored_bytes)
        p2 = {"seconds": seconds, "wall_s": wall_s, "ranks_reporting": len(got),
              "store_bytes": store_b, "retrieve_bytes": ret_b,
              "store_gbps": store_b / seconds / 1e9, "retrieve_gbps": ret_b / seconds / 1e9,
              "mismatched_bytes": sum(g["mismatched_bytes"] for g in got),
              "checked_bytes": sum(g["checked_bytes"] for g in got),
              "verified_requests": sum(g["verified_requests"] for g in got),
              "errors": sum(g["store"]["errors"] + g["retrieve"]["errors"] for g in got),
              "failed_statuses": sum(g["store"]["status"]["failed"]
                                     + g["store"]["status"]["no_space"]
                                     + g["retrieve"]["status"]["failed"] for g in got),
              "retrieve_misses": sum(g["retrieve"]["status"]["miss"] for g in got),
              "store_in_progress": sum(g["store"]["status"]["in_progress"] for g in got),
              "error_samples": [e for g in got for d in ("store", "retrieve")
                                for e in g[d]["error_samples"]][:MAX_ERRORS_KEPT]}
        p2["store_ratio"] = p2["store_gbps"] / raw["d2h_gbps"] if raw["d2h_gbps"] else None
        p2["retrieve_ratio"] = (p2["retrieve_gbps"] / raw["h2d_gbps"] if raw["h2d_gbps"]
                                else None)
        l1 = {"used_bytes": s1.l1.used_bytes, "capacity_bytes": s1.l1.capacity_bytes,
              "distinct_bytes_phase2": distinct_b, "copied_bytes_phase2": copies_b,
              "copies_per_distinct_chunk": copies_b / distinct_b if distinct_b else None,
              "one_copy_per_rank_bytes": cfg.ranks * distinct_b,
              "evicted_bytes_phase2": evicted_b, "unknown_bytes_phase2": unknown_b,
              # what L1 held when phase 2 began (phase 1, TP stores) plus phase 2's
              "single_copy_bytes": s0.l1.used_bytes + distinct_b - evicted_b,
              "writing_objects": sum(p.writing for p in s1.partitions)}
        self.s["phase2"], self.s["l1"] = p2, l1
        by_rank = {r.rank: g for r, g in zip(survivors, got, strict=True)}
        for row in self.report.rows:
            g = by_rank.get(row["rank"])
            row.update(alive=g is not None,
                       p2_store_gbps=g["store"]["copied_bytes"] / g["seconds"] / 1e9
                       if g else None,
                       p2_retrieve_gbps=g["retrieve"]["copied_bytes"] / g["seconds"] / 1e9
                       if g else None,
                       p2_errors=(g["store"]["errors"] + g["retrieve"]["errors"]) if g else None,
                       p2_mismatched_bytes=g["mismatched_bytes"] if g else None)
        self.checks.update({
            "p2 survivors: no errors": p2["errors"] == 0 and p2["failed_statuses"] == 0,
            "p2 verified bytes match": p2["mismatched_bytes"] == 0 and p2["checked_bytes"] > 0,
            "p2 replicated KV copied once": (
                distinct_b <= copies_b <= distinct_b + unknown_b + evicted_b),
            "p2 L1 used == stored - evicted": (
                l1["used_bytes"] == stored_total - evicted_total),
            "p2 no unfinished writes left": l1["writing_objects"] == 0,
        })
        if evicted_total == 0 and unknown_b == 0:
            self.checks["p2 L1 used == distinct chunks x chunk bytes"] = (
                l1["used_bytes"] == l1["single_copy_bytes"])

    def phase3(self, victim: _Rank) -> None:
        before = self.admin.stats().registrations
        victim.kill()
        t0 = time.monotonic()
        pid = self.srv.proc.pid if self.srv.proc is not None else 0
        names = victim.info.get("segments", [])
        detect_s = unmapped_s = None
        while time.monotonic() - t0 < KILL_DETECT_S:
            now = time.monotonic() - t0
            if detect_s is None and self.admin.stats().registrations == before - 1:
                detect_s = now
            if names and unmapped_s is None and _maps_hold(pid, names) is False:
                unmapped_s = now
            if detect_s is not None and (unmapped_s is not None or not names):
                break
            time.sleep(0.05)
        p3 = {"victim_rank": victim.rank, "registrations_before": before,
              "registrations_after": self.admin.stats().registrations,
              "detected_s": detect_s, "unmapped_s": unmapped_s,
              "limit_s": KILL_DETECT_S}
        self.s["phase3"] = p3
        self.checks["p3 dead rank's registration dropped within 5 s"] = detect_s is not None
        if names:
            self.checks["p3 dead rank's segments unmapped within 5 s"] = unmapped_s is not None

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def run(cfg: RanksConfig) -> Report:
    if cfg.ranks < 1 or cfg.chunks < 1 or cfg.batch < 1 or cfg.batch > cfg.chunks:
        raise ValueError("need ranks >= 1, chunks >= 1 and 1 <= batch <= chunks")
    if not set(cfg.tp_modes) <= {"load", "mixed"} or cfg.tp_inflight < 1:
        raise ValueError("tp modes are 'load' and 'mixed'; tp inflight >= 1")
    probe = cfg.geometry.build(1)
    need = blocks_needed(probe, cfg.chunks)
    num_blocks = cfg.num_blocks or need
    if num_blocks < need:
        raise ValueError(f"--num-blocks {num_blocks}: {cfg.chunks} chunks in two regions "
                         f"need {need}")
    chunk_bytes = build_layout(probe.groups, CHUNK_SIZE, separate=True).chunk_bytes
    l1_gb = cfg.l1_size_gb or auto_l1_size_gb(chunk_bytes, cfg.chunks)
    if l1_gb * (1 << 30) < 1.1 * cfg.chunks * chunk_bytes:
        raise ValueError(f"--l1-size-gb {l1_gb}: phase 1 needs "
                         f"{cfg.chunks * chunk_bytes / (1 << 30):.2f} GiB and some room")
    report = Report("ranks", {
        "backend": cfg.backend, "ranks": cfg.ranks, "chunks": cfg.chunks,
        "duration_s": cfg.duration_s, "kill_one": cfg.kill_one, "batch": cfg.batch,
        "geometry": cfg.geometry.describe(), "num_blocks": num_blocks,
        "chunk_size": CHUNK_SIZE, "l1_size_gb": l1_gb, "verify_every": cfg.verify_every,
        "tp_modes": list(cfg.tp_modes), "tp_s": cfg.tp_s,
        "tp_chunks": min(cfg.tp_chunks or cfg.batch, cfg.chunks), "tp_inflight": cfg.tp_inflight,
        "separate_object_groups": True, "eviction_policy": "LRU"})
    args = ["--chunk-size", str(CHUNK_SIZE), "--separate-object-groups",
            "--eviction-policy", "LRU", "--log-level", "WARNING"]
    with ServerProcess(args, backend=cfg.backend, l1_size_gb=l1_gb,
                       start_timeout_s=120) as srv, Client(srv.endpoint, timeout_s=60) as admin:
        report.summary["pool_ready_s"] = srv.wait_pool_ready(POOL_READY_TIMEOUT_S)
        r = _Run(cfg, report, srv, admin)
        try:
            r.start_ranks(num_blocks)
            r.phase1()
            r.raw()
            for mode in cfg.tp_modes:
                r.tp(mode)
            r.phase2()
        finally:
            r.close()
        report.summary["registrations_at_end"] = admin.stats().registrations
    report.summary["checks"] = r.checks
    report.summary["ok"] = all(r.checks.values())
    _notes(report, cfg)
    return report


def _notes(report: Report, cfg: RanksConfig) -> None:
    raw = ("pinned cudaMemcpy on every GPU at once (testing.cuda_kv.raw_copy_gbps, one "
           "process per GPU), summed" if cfg.backend == "cuda" else
           "numpy copies shm <-> populated anonymous memory in every rank process at "
           "once, summed")
    report.notes += [
        f"raw = {raw}; ours = bytes copied by the server for all ranks (OK statuses x "
        "object bytes) / phase seconds",
        "phase 2: every rank stores the same fresh chunk sequence (the first copies, the "
        "others get EXISTS or IN_PROGRESS) and retrieves chunks it saw committed",
        "p2 single copy: distinct <= server stored bytes <= distinct + unknown (a killed "
        "rank's in-flight writes) + evicted (re-stored after eviction)",
    ]
    for name, ok in report.summary["checks"].items():
        report.notes.append(f"check {'PASS' if ok else 'FAIL'}: {name}")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def table(report: Report) -> str:
    """Per-rank rows, then the aggregate figures."""
    ranks = format_table(report.rows, [
        ("rank", "rank", "d"), ("device", "dev", "d"), ("alive", "alive", ""),
        ("p1_checked_bytes", "p1 checked B", "d"),
        ("p1_mismatched_bytes", "p1 mismatch B", "d"),
        ("tp_load_retrieve_gbps", "tp load GB/s", ".2f"),
        ("p2_store_gbps", "p2 store GB/s", ".2f"),
        ("p2_retrieve_gbps", "p2 retr GB/s", ".2f"),
        ("p2_errors", "p2 errors", "d"), ("p2_mismatched_bytes", "p2 mismatch B", "d")])
    s = report.summary
    p2, raw, l1 = s.get("phase2", {}), s.get("raw", {}), s.get("l1", {})
    agg = []
    for mode in ("load", "mixed"):
        tp = s.get(f"tp_{mode}")
        if tp is None:
            continue
        agg.append({"what": f"tp {mode}: retrieve GB/s (H2D), all ranks",
                    "ours": tp["retrieve_gbps"], "ref": raw.get("h2d_gbps"),
                    "ratio": tp["retrieve_ratio"]})
        if tp["store_requests"]:
            agg.append({"what": f"tp {mode}: store GB/s (D2H), rank 0",
                        "ours": tp["store_gbps"], "ref": raw.get("d2h_gbps"),
                        "ratio": tp["store_ratio"]})
    agg += [
        {"what": "p2 store GB/s (D2H), all ranks, with checks", "ours": p2.get("store_gbps"),
         "ref": raw.get("d2h_gbps"), "ratio": p2.get("store_ratio")},
        {"what": "p2 retrieve GB/s (H2D), all ranks, with checks",
         "ours": p2.get("retrieve_gbps"),
         "ref": raw.get("h2d_gbps"), "ratio": p2.get("retrieve_ratio")},
        {"what": "L1 used bytes vs one copy", "ours": l1.get("used_bytes"),
         "ref": l1.get("single_copy_bytes"), "ratio": None},
        {"what": "p2 bytes copied vs distinct", "ours": l1.get("copied_bytes_phase2"),
         "ref": l1.get("distinct_bytes_phase2"), "ratio": l1.get("copies_per_distinct_chunk")},
        {"what": "dead rank detected (s)", "ours": s.get("phase3", {}).get("detected_s"),
         "ref": KILL_DETECT_S, "ratio": None},
    ]
    rows = [{k: (_fmt(v) if k != "what" else v) for k, v in a.items()} for a in agg]
    totals = format_table(rows, [("what", "aggregate", ""), ("ours", "ours", ""),
                                 ("ref", "raw / expected", ""), ("ratio", "ratio", "")])
    return f"{ranks}\n\n{totals}\n\nresult: {'PASS' if s.get('ok') else 'FAIL'}"

