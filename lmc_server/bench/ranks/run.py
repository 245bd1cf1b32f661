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
rank retrieving the same prefix of ``chunks`` phase-1 chunks into its own GPU at once
(``inflight`` requests in flight each, 1 = a rank waits for its load before the next,
as before a prefill); ``mixed`` adds rank 0 storing fresh chunks meanwhile. Each mode
runs once per (chunks, inflight) pair of ``tp_chunks`` x ``tp_inflight``, on the same
server. Per rank and aggregate GB/s per direction against the raw aggregate; after each
loop, one poisoned retrieve per rank is compared byte for byte.

Every timed phase (each TP phase, phase 2, the DP phase) also reads the server's CPU by
thread inside the phase (:mod:`.serverload`): CPU per request by thread group, busy
fractions, the busiest thread, and the request rate at which it would saturate.

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

DP mode (``mode="dp"``, :mod:`.dp`): the processes are independent engines
instead (world size 1 each, one namespace); after the raw baseline, one DP phase of
``duration_s`` in which each stores its own prompts and loads prefixes any engine stored,
at its own pace, every loaded prefix checked byte for byte; phase 3 as above.

Modules: :mod:`.config` (settings both sides share), :mod:`.soak` (phase 2),
:mod:`.kill` (phase 3), :mod:`.procs` (the rank processes), :mod:`.serverload` (the
server's CPU in a phase), :mod:`.table` (notes and tables), :mod:`.plot` (the picture),
:mod:`.worker`, :mod:`.dp_worker` and :mod:`.kv` (a rank: its commands,
a DP engine's loops, its KV and byte checks).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from lmc_server.bench.common import Report
from lmc_server.bench.ranks.config import (
    MAX_TP_INFLIGHT,
    MODES,
    POOL_READY_TIMEOUT_S,
    RAW_MIN_BYTES,
    TP_MODES,
    RanksConfig,
    auto_l1_size_gb,
    blocks_needed,
    tp_pairs,
)
from lmc_server.bench.ranks.dp import dp_phase
from lmc_server.bench.ranks.kill import kill_phase
from lmc_server.bench.ranks.procs import RankProcess, gather
from lmc_server.bench.ranks.serverload import ServerLoad
from lmc_server.bench.ranks.soak import soak_phase
from lmc_server.bench.ranks.table import notes
from lmc_server.bench.servers import server_flags
from lmc_server.cache.layout import build_layout
from lmc_server.client.sync import Client
from lmc_server.testing.process import ServerProcess

log = logging.getLogger(__name__)


class _Run:
    """State of one benchmark run; methods are the phases, in order."""

    def __init__(self, cfg: RanksConfig, report: Report, srv: ServerProcess, admin: Client) -> None:
        self.cfg, self.report, self.srv, self.admin = cfg, report, srv, admin
        self.ranks: list[RankProcess] = []
        self.s: dict[str, Any] = report.summary
        self.checks: dict[str, bool] = {}
        self.chunk_bytes = 0
        self.object_bytes: dict[str, int] = {}

    def start_ranks(self, num_blocks: int) -> None:
        cfg = self.cfg
        base = {
            "endpoint": self.srv.endpoint,
            "mode": cfg.mode,
            "backend": cfg.backend,
            "ranks": cfg.ranks,
            "chunks": cfg.chunks,
            "batch": cfg.batch,
            "seed": cfg.seed,
            "geometry": asdict(cfg.geometry),
            "num_blocks": num_blocks,
            "chunk_size": cfg.chunk_size,
        }
        for rank in range(cfg.ranks):
            self.ranks.append(RankProcess(rank, {**base, "rank": rank}))
        for r in self.ranks:
            r.info = r.recv(POOL_READY_TIMEOUT_S)
        info = self.ranks[0].info
        self.chunk_bytes, self.object_bytes = info["chunk_bytes"], info["object_bytes"]
        assert len({r.info["namespace"] for r in self.ranks}) == 1, "one namespace"
        self.report.config.update(
            chunk_bytes=self.chunk_bytes,
            arch=info["arch"],
            namespace=info["namespace"],
            devices=[r.info["device"] for r in self.ranks],
        )
        self.checks["all ranks registered"] = self.admin.stats().registrations == cfg.ranks

    def phase1(self) -> None:
        cfg, n_og = self.cfg, len(self.object_bytes)
        one_copy = cfg.chunks * self.chunk_bytes
        s0 = self.admin.stats()
        first = self.ranks[0].call({"cmd": "p1_store"}, 3600)
        s1 = self.admin.stats()
        rest = gather(self.ranks[1:], {"cmd": "p1_store"}, 3600)
        s2 = self.admin.stats()
        got = gather(self.ranks, {"cmd": "p1_retrieve"}, 3600)
        p1 = {
            "store_rank0": first,
            "store_others_exists": [r["status"]["exists"] for r in rest],
            "one_copy_bytes": one_copy,
            "l1_used_after_rank0": s1.l1.used_bytes,
            "l1_used_after_all": s2.l1.used_bytes,
            "stored_bytes_rank0": s1.counters.stored_bytes - s0.counters.stored_bytes,
            "stored_bytes_others": s2.counters.stored_bytes - s1.counters.stored_bytes,
            "mismatched_bytes": sum(r["mismatched_bytes"] for r in got),
            "checked_bytes": sum(r["checked_bytes"] for r in got),
            "retrieve_errors": sum(
                r["errors"] + r["status"]["miss"] + r["status"]["failed"] for r in got
            ),
            "retrieve_s": max(r["seconds"] for r in got),
        }
        self.s["phase1"] = p1
        for r, g in zip(self.ranks, got, strict=True):
            self.report.rows.append(
                {
                    "rank": r.rank,
                    "pid": r.info["pid"],
                    "device": r.info["device"],
                    "p1_checked_bytes": g["checked_bytes"],
                    "p1_mismatched_bytes": g["mismatched_bytes"],
                }
            )
        self.checks.update(
            {
                "p1 rank 0 stored every chunk once": (
                    first["status"]["ok"] == cfg.chunks * n_og
                    and first["errors"] == 0
                    and p1["stored_bytes_rank0"] == one_copy
                ),
                "p1 other ranks: every chunk EXISTS": all(
                    r["status"]["exists"] == cfg.chunks * n_og
                    and r["status"]["ok"] == 0
                    and r["errors"] == 0
                    for r in rest
                )
                and p1["stored_bytes_others"] == 0,
                "p1 L1 used == one copy": s1.l1.used_bytes == s2.l1.used_bytes == one_copy,
                "p1 every byte on every rank": p1["mismatched_bytes"] == 0
                and p1["retrieve_errors"] == 0
                and p1["checked_bytes"] == cfg.ranks * one_copy,
            }
        )

    def raw(self) -> None:
        cfg = self.cfg
        if cfg.backend == "cuda":
            first_on: dict[int, RankProcess] = {}
            for r in self.ranks:
                first_on.setdefault(r.info["device"], r)
            part = list(first_on.values())
        else:
            part = list(self.ranks)
        nbytes = max(cfg.batch * self.chunk_bytes, RAW_MIN_BYTES)
        gather(part, {"cmd": "raw_prepare", "nbytes": nbytes, "raw_s": cfg.raw_s}, 600)
        raw: dict[str, Any] = {"processes": len(part), "bytes_per_copy": nbytes}
        for d in ("d2h", "h2d"):
            per = [
                g["gbps"]
                for g in gather(part, {"cmd": "raw_go", "direction": d, "raw_s": cfg.raw_s}, 600)
            ]
            raw[f"{d}_gbps"] = sum(per)
            raw[f"{d}_gbps_per_process"] = per
        self.s["raw"] = raw

    def load(self, duration_s: float) -> ServerLoad:
        """The server's CPU by thread over a phase that starts now (:mod:`.serverload`)."""
        assert self.srv.proc is not None
        return ServerLoad.for_phase(self.srv.proc.pid, self.srv.endpoint, duration_s)

    def tp(self, mode: str, n: int, inflight: int, single: bool) -> None:
        """One TP phase (module docstring): aggregate and per-rank GB/s, byte check,
        the server's CPU. ``single``: the only (chunks, inflight) pair of the run, whose
        entry is also ``tp_<mode>`` and whose per-rank GB/s go in the rank rows."""
        cfg = self.cfg
        load = self.load(cfg.tp_s)
        got = gather(
            self.ranks,
            {
                "cmd": "tp",
                "mode": mode,
                "duration_s": cfg.tp_s,
                "chunks": n,
                "inflight": inflight,
                "tag": f"{mode}-{n}x{inflight}",
            },
            cfg.tp_s + 600,
        )
        seconds = max(g["seconds"] for g in got)
        raw = self.s["raw"]
        res: dict[str, Any] = {"mode": mode, "chunks": n, "inflight": inflight, "seconds": seconds}
        for d, key in (("retrieve", "h2d_gbps"), ("store", "d2h_gbps")):
            nbytes = sum(g[d]["copied_bytes"] for g in got)
            requests = sum(g[d]["requests"] for g in got)
            res[f"{d}_gbps"] = nbytes / seconds / 1e9
            res[f"{d}_ratio"] = res[f"{d}_gbps"] / raw[key] if raw[key] else None
            res[f"{d}_requests"] = requests
            res[f"{d}_ms_per_request"] = (
                1e3 * sum(g[d]["busy_s"] for g in got) / requests if requests else None
            )
            res[f"{d}_gbps_per_rank"] = [g[d]["copied_bytes"] / g["seconds"] / 1e9 for g in got]
        res["errors"] = sum(g[d]["errors"] for g in got for d in ("retrieve", "store"))
        res["failed_statuses"] = sum(
            g["retrieve"]["status"][s] for g in got for s in ("miss", "failed")
        )
        res["mismatched_bytes"] = sum(g["mismatched_bytes"] for g in got)
        res["checked_bytes"] = sum(g["checked_bytes"] for g in got)
        res["server_cpu"] = load.result()
        self.s.setdefault("tp", []).append(res)
        if single:
            self.s[f"tp_{mode}"] = res
            for row, g in zip(self.report.rows, got, strict=True):
                row[f"tp_{mode}_retrieve_gbps"] = g["retrieve"]["copied_bytes"] / g["seconds"] / 1e9
        what = f"tp {mode}" if single else f"tp {mode} {n} chunks x {inflight} in flight"
        self.checks[f"{what}: no errors, every byte checked"] = (
            res["errors"] == 0
            and res["failed_statuses"] == 0
            and res["mismatched_bytes"] == 0
            and res["checked_bytes"] > 0
            and all(g["verify_ok"] for g in got)
            and res["retrieve_requests"] > 0
        )

    def phase2(self) -> None:
        """Phase 2, the correctness soak (:mod:`.soak`), phase 3 inside it when
        ``kill_one``."""
        self.s["phase2"], self.s["l1"], checks = soak_phase(
            self.cfg,
            self.ranks,
            self.admin,
            self.object_bytes,
            self.s["raw"],
            self.report.rows,
            self.phase3,
            self.load,
        )
        self.checks.update(checks)

    def dp(self) -> None:
        """The DP phase (:mod:`.dp`), phase 3 inside it when ``kill_one``."""
        self.s["dp"], self.report.rows, checks = dp_phase(
            self.cfg, self.ranks, self.admin, self.s["raw"], self.phase3, self.load
        )
        self.checks.update(checks)

    def phase3(self, victim: RankProcess) -> None:
        """Phase 3, one rank killed (:mod:`.kill`)."""
        pid = self.srv.proc.pid if self.srv.proc is not None else 0
        self.s["phase3"], checks = kill_phase(victim, self.admin, pid)
        self.checks.update(checks)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def run(cfg: RanksConfig) -> Report:
    if cfg.ranks < 1 or cfg.chunks < 1 or cfg.batch < 1 or cfg.batch > cfg.chunks:
        raise ValueError("need ranks >= 1, chunks >= 1 and 1 <= batch <= chunks")
    if not set(cfg.tp_modes) <= set(TP_MODES):
        raise ValueError(f"tp modes are {' and '.join(map(repr, TP_MODES))}")
    if not cfg.tp_inflight or not all(1 <= i <= MAX_TP_INFLIGHT for i in cfg.tp_inflight):
        raise ValueError(f"--tp-inflight: between 1 and {MAX_TP_INFLIGHT} requests per rank")
    pairs = tp_pairs(cfg)
    longest = max(c for c, _ in pairs)
    if cfg.mode == "tp" and cfg.tp_modes and (min(c for c, _ in pairs) < 1 or longest > cfg.chunks):
        raise ValueError(
            f"--tp-chunks {longest}: the TP phases load a prefix phase 1 stored; "
            f"give --chunks {longest} or more (now {cfg.chunks})"
        )
    if cfg.mode not in MODES:
        raise ValueError(f"mode {cfg.mode!r}: choose from {', '.join(MODES)}")
    if cfg.mode == "dp" and cfg.chunks < 2 * cfg.batch:
        raise ValueError(
            f"--chunks {cfg.chunks}: DP loads into two halves of region B, "
            f"so it needs at least twice --batch ({2 * cfg.batch})"
        )
    probe = cfg.geometry.build(1)
    need = blocks_needed(probe, cfg.chunks, cfg.chunk_size)
    num_blocks = cfg.num_blocks or need
    if num_blocks < need:
        raise ValueError(
            f"--num-blocks {num_blocks}: {cfg.chunks} chunks in two regions need {need}"
        )
    chunk_bytes = build_layout(probe.groups, cfg.chunk_size, separate=True).chunk_bytes
    l1_gb = cfg.l1_size_gb or auto_l1_size_gb(chunk_bytes, cfg.chunks)
    if l1_gb * (1 << 30) < 1.1 * cfg.chunks * chunk_bytes:
        raise ValueError(
            f"--l1-size-gb {l1_gb}: phase 1 needs "
            f"{cfg.chunks * chunk_bytes / (1 << 30):.2f} GiB and some room"
        )
    tp_only = {
        "verify_every": cfg.verify_every,
        "tp_modes": list(cfg.tp_modes),
        "tp_s": cfg.tp_s,
        "tp_chunks": list(cfg.tp_chunks or (cfg.batch,)),
        "tp_inflight": list(cfg.tp_inflight),
    }
    copy_mode = cfg.cuda_copy_mode if cfg.backend == "cuda" else ""  # cpu: no such flag
    report = Report(
        "ranks",
        {
            "mode": cfg.mode,
            "backend": cfg.backend,
            "ranks": cfg.ranks,
            "chunks": cfg.chunks,
            "duration_s": cfg.duration_s,
            "kill_one": cfg.kill_one,
            "cuda_copy_mode": copy_mode or None,
            "batch": cfg.batch,
            "geometry": cfg.geometry.describe(),
            "num_blocks": num_blocks,
            "chunk_size": cfg.chunk_size,
            "l1_size_gb": l1_gb,
            **(tp_only if cfg.mode == "tp" else {}),
            "separate_object_groups": True,
            "eviction_policy": "LRU",
        },
    )
    args = server_flags(
        cfg.chunk_size,
        True,
        "--eviction-policy",
        "LRU",
        copy_mode=copy_mode,
    )
    with (
        ServerProcess(args, backend=cfg.backend, l1_size_gb=l1_gb, start_timeout_s=120) as srv,
        Client(srv.endpoint, timeout_s=60) as admin,
    ):
        report.summary["pool_ready_s"] = srv.wait_pool_ready(POOL_READY_TIMEOUT_S)
        r = _Run(cfg, report, srv, admin)
        try:
            r.start_ranks(num_blocks)
            if cfg.mode == "dp":
                r.raw()
                r.dp()
            else:
                r.phase1()
                r.raw()
                for mode in cfg.tp_modes:
                    for n, inflight in pairs:
                        r.tp(mode, n, inflight, single=len(pairs) == 1)
                r.phase2()
        finally:
            r.close()
        report.summary["registrations_at_end"] = admin.stats().registrations
    report.summary["checks"] = r.checks
    report.summary["ok"] = all(r.checks.values())
    notes(report, cfg)
    return report
