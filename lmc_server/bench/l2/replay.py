"""``lmcache bench l2 --replay TRACE``: hit ratio per tier with a small L1 and a larger L2.

The request trace of ``lmcache bench replay`` is replayed, in timestamp order, against a
real server with the CPU backend and real bytes (a small geometry keeps them few),
twice: with L1 alone, and with the same L1 plus an L2 (a redis-server started here with
``maxmemory`` set to ``--l2-fraction`` of the trace's distinct chunk bytes and
``allkeys-lru``). Per request, as a connector would: ``lookup`` (its hit is the L1 hit);
while ``l2_pending_chunks`` says more is coming, look up again (every millisecond, at
most ``POLL_LIMIT_S``); then ``lookup`` with a lease (the final hit, L1 plus what L2
brought), ``store`` of the chunks after it, ``release``. Writes to L2 are not waited
for, as in service: a chunk stored by one request is in L2 for the next only if the
write-behind got there first. Token hit ratio = hit chunks x 256 / input tokens, next
to the infinite-cache ratio of the same requests.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import numpy as np

from lmc_server.bench.common import Report, format_table, progress
from lmc_server.bench.l2.config import L2Config
from lmc_server.bench.servers import server_flags
from lmc_server.bench.traces.bounds import infinite_hits
from lmc_server.bench.traces.tierpolicy import POLICIES, simulate
from lmc_server.bench.traces.trace import CHUNK_TOKENS, TraceRequest, chunk_ids, load_trace
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.layout import build_layout
from lmc_server.client import Client
from lmc_server.config import GIB, MIB
from lmc_server.protocol.stats import L2Report, StatsReport
from lmc_server.testing.kv import ShmKV
from lmc_server.testing.poll import wait_for
from lmc_server.testing.process import ServerProcess, wait_pool_ready
from lmc_server.testing.redis_process import RedisProcess

POLL_S = 0.001
POLL_LIMIT_S = 2.0
#: Redis memory per value beyond its payload: our 80-byte header and Redis' own key
#: and allocation overhead (about 100 bytes, measured as used_memory / keys here).
VALUE_OVERHEAD_BYTES = 200


def _drive(
    endpoint: str, requests: list[TraceRequest], kv: ShmKV, bar: Any
) -> tuple[int, int, StatsReport]:
    """Replay once on a ready server; (L1 hit chunks, L2 hit chunks, final stats)."""
    l1 = l2 = 0
    wait_pool_ready(endpoint)  # a store before the first slab is answered busy
    with Client(endpoint, timeout_s=120, client_name="lmcache-bench-l2-replay") as c:
        reg = c.register(**kv.register_kwargs())
        bpc = {g.name: blocks_per_chunk(g, CHUNK_TOKENS) for g in reg.groups if g.cached}
        for r in requests:
            bar.update(1)
            n = r.n_chunks
            if n == 0:
                continue
            first = c.lookup(reg, r.digests, lease=False)
            if first.l2_pending_chunks:  # as a connector does: wait a while, not forever
                with contextlib.suppress(TimeoutError):
                    wait_for(
                        lambda: not c.lookup(reg, r.digests, lease=False).l2_pending_chunks,  # noqa: B023
                        "the lower tier's reads",
                        POLL_LIMIT_S,
                        POLL_S,
                        TimeoutError,
                    )
            res = c.lookup(reg, r.digests, lease=True)
            h = res.hit_chunks
            l1 += min(first.hit_chunks, h)
            l2 += max(0, h - first.hit_chunks)
            if h < n:
                ids = {name: np.arange((n - h) * b, dtype=np.int32) for name, b in bpc.items()}
                c.store(reg, r.digests[32 * h :], ids)
            if res.lease_id:
                c.release(res.lease_id)
        stats = c.stats()
    return l1, l2, stats


def run(cfg: L2Config) -> Report:
    assert cfg.trace is not None, "the trace to replay"
    disk = cfg.replay_tier == "disk"
    requests = load_trace(cfg.trace, cfg.limit)
    chunks, distinct = chunk_ids(requests)
    max_chunks = max((r.n_chunks for r in requests), default=1) or 1
    probe = cfg.geometry.build(1)
    max_bpc = max(blocks_per_chunk(g, CHUNK_TOKENS) for g in probe.groups if g.cached)
    geometry = cfg.geometry.build(max(1, max_chunks * max_bpc))
    chunk_bytes = build_layout(geometry.groups, CHUNK_TOKENS, False).chunk_bytes
    slab_bytes = cfg.slab_size_mb * MIB
    distinct_bytes = distinct * chunk_bytes
    n_slabs = max(1, int(cfg.l1_fraction * distinct_bytes // slab_bytes))
    l1_gb = n_slabs * slab_bytes / GIB
    l2_mb = max(1, int(cfg.l2_fraction * distinct * (chunk_bytes + VALUE_OVERHEAD_BYTES) / MIB))
    total_tokens = sum(r.input_tokens for r in requests)
    infinite = sum(infinite_hits(chunks)) * CHUNK_TOKENS / total_tokens
    report = Report(
        "l2-replay",
        {
            "trace": cfg.trace,
            "requests": len(requests),
            "limit": cfg.limit,
            "input_tokens": total_tokens,
            "distinct_chunks": distinct,
            "chunk_bytes": chunk_bytes,
            "geometry": cfg.geometry.describe(),
            "l1_fraction": cfg.l1_fraction,
            "l1_size_gb": l1_gb,
            "l2_fraction": cfg.l2_fraction,
            "l2_maxmemory_mb": l2_mb,
            "slab_size_mb": cfg.slab_size_mb,
        },
    )
    report.summary["infinite_ratio"] = infinite
    more = ["--slab-size-mb", str(cfg.slab_size_mb), "--eviction-policy", "LRU"]
    args = server_flags(CHUNK_TOKENS, False, *more)
    disk_gb = cfg.l2_fraction * distinct * (chunk_bytes + VALUE_OVERHEAD_BYTES) / GIB
    if disk:
        report.config["disk_size_gb"] = disk_gb
    with ShmKV(geometry) as kv, progress(2 * len(requests), "l2 replay", cfg.show_progress) as bar:
        for tier in ("L1 only", "L1 + disk" if disk else "L1 + L2"):
            l2_stats: L2Report | None = None
            if tier == "L1 only":
                with ServerProcess(args, l1_size_gb=l1_gb) as srv:
                    l1, l2, stats = _drive(srv.endpoint, requests, kv, bar)
            elif disk:
                with (
                    tempfile.TemporaryDirectory(prefix="lmc-replay-disk-") as d,
                    ServerProcess(
                        [*args, "--disk-dir", d, "--disk-size-gb", f"{disk_gb:.6f}"],
                        l1_size_gb=l1_gb,
                    ) as srv,
                ):
                    l1, l2, stats = _drive(srv.endpoint, requests, kv, bar)
                    l2_stats = stats.disk
            else:
                with (
                    RedisProcess(maxmemory_mb=l2_mb) as rp,
                    ServerProcess([*args, "--l2", rp.url], l1_size_gb=l1_gb) as srv,
                ):
                    l1, l2, stats = _drive(srv.endpoint, requests, kv, bar)
                    l2_stats = stats.l2
            report.rows.append(
                {
                    "tier": tier,
                    "l1_hit_ratio": l1 * CHUNK_TOKENS / total_tokens,
                    "l2_hit_ratio": l2 * CHUNK_TOKENS / total_tokens,
                    "hit_ratio": (l1 + l2) * CHUNK_TOKENS / total_tokens,
                    "evictions": stats.counters.evictions,
                    "l2_written": l2_stats.objects_written if l2_stats else None,
                    "l2_dropped": sum(l2_stats.dropped_writes.values()) if l2_stats else None,
                    "l2_dropped_by_reason": l2_stats.dropped_writes if l2_stats else None,
                    "infinite_ratio": infinite,
                    "l2_invalid": sum(l2_stats.invalid.values()) if l2_stats else None,
                    "written_per_hit": l2_stats.objects_written / max(1, l2) if l2_stats else None,
                }
            )
    if disk:
        _model_rows(
            report,
            chunks,
            n_slabs * (slab_bytes // chunk_bytes),
            int(disk_gb * GIB // (chunk_bytes + VALUE_OVERHEAD_BYTES)),
            total_tokens,
            infinite,
            chunk_bytes,
        )
    report.notes.append(
        f"{len(requests)} requests, {distinct} distinct chunks of {chunk_bytes} B "
        f"({distinct_bytes / MIB:.1f} MiB); L1 {l1_gb * 1024:.1f} MiB "
        f"({cfg.l1_fraction:g} of distinct), L2 maxmemory {l2_mb} MiB "
        f"({cfg.l2_fraction:g} of distinct, allkeys-lru)"
    )
    return report


def _model_rows(
    report: Report,
    chunks: list[list[int]],
    l1_chunks: int,
    disk_chunks: int,
    total_tokens: int,
    infinite: float,
    chunk_bytes: int,
) -> None:
    """The three disk write policies, modelled on the same trace and capacities."""
    report.config["model_l1_chunks"], report.config["model_disk_chunks"] = l1_chunks, disk_chunks
    for policy in POLICIES:
        r = simulate(chunks, l1_chunks, disk_chunks, policy)
        report.rows.append(
            {
                "tier": f"model: disk at {policy}",
                "l1_hit_ratio": r.l1_hit_chunks * CHUNK_TOKENS / total_tokens,
                "l2_hit_ratio": r.disk_hit_chunks * CHUNK_TOKENS / total_tokens,
                "hit_ratio": (r.l1_hit_chunks + r.disk_hit_chunks) * CHUNK_TOKENS / total_tokens,
                "evictions": None,
                "l2_written": r.disk_writes,
                "l2_dropped": None,
                "l2_dropped_by_reason": None,
                "infinite_ratio": infinite,
                "l2_invalid": None,
                "written_per_hit": r.disk_writes / max(1, r.disk_hit_chunks),
                "written_bytes": r.disk_writes * chunk_bytes,
                "l1_kept_on_disk": r.l1_kept_on_disk,
            }
        )


def table(report: Report) -> str:
    return format_table(
        report.rows,
        (
            "tier|tiers; l1_hit_ratio|L1 token hit|.4f; l2_hit_ratio|L2 token hit|.4f; "
            "hit_ratio|total|.4f; infinite_ratio|infinite|.4f; evictions|L1 evictions|d; "
            "l2_written|L2 writes|d; l2_dropped|L2 dropped|d; l2_invalid|L2 invalid|d; "
            "written_per_hit|writes per lower hit|.2f; "
            "l1_kept_on_disk|L1 kept on disk|.2f"
        ),
    )
