"""``lmcache bench replay``: token hit ratio of a real server on a request trace.

For every L1 size (a fraction of the trace's distinct chunk bytes) and eviction policy
a fresh server with ``--backend null`` (full bookkeeping, no bytes moved) replays the
trace in timestamp order, one request at a time, as a vLLM worker would drive it:
``lookup`` (with a lease) of the request's chunk digests, ``store`` of the chunks after
the hit prefix, ``release`` of the lease. The token hit ratio is tokens served from
cache / input tokens, with hits in whole 256-token chunks as ``lookup`` reports them.

Next to each server figure: the infinite-cache ratio and Belady's offline optimum at
the same capacity in objects as the server (``slabs * (slab bytes // object bytes)``,
one object per chunk: the server runs with combined object groups here, so that an
object is a chunk and the bounds compare like with like).
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass
from typing import Any

import click
import numpy as np

from lmc_server.bench.common import GeometryArgs, Report, format_table, progress
from lmc_server.bench.options import floats, opt
from lmc_server.bench.servers import server
from lmc_server.bench.traces.bounds import belady_hits, infinite_hits
from lmc_server.bench.traces.trace import CHUNK_TOKENS, TraceRequest, chunk_ids, load_trace
from lmc_server.buffers import ShmBuffer
from lmc_server.cache.eviction.registry import POLICIES
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.layout import build_layout
from lmc_server.cache.slabs import slot_stride
from lmc_server.client.sync import Client
from lmc_server.config import GIB, MIB
from lmc_server.protocol.stats import StatsReport


def _policies(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, ...]:
    names = tuple(p.strip().upper() for p in value.split(",") if p.strip())
    if set(names) - set(POLICIES) or not names:
        raise click.BadParameter(f"choose from {', '.join(POLICIES)}", param_hint="--policies")
    return names


@dataclass(frozen=True)
class ReplayConfig:
    trace: str = opt(
        MISSING,
        "Trace file (JSON lines: timestamp, input_length, hash_ids).",
        type=click.Path(exists=True, dir_okay=False),
    )
    fractions: tuple[float, ...] = opt(
        (0.01, 0.05, 0.1, 0.25, 0.5),
        "L1 sizes as fractions of the trace's distinct chunk bytes.",
        parse=floats,
    )
    policies: tuple[str, ...] = opt(
        ("LRU", "FIFO", "ARC", "S3FIFO", "SARC"),
        "Eviction policies, comma-separated.",
        parse=_policies,
    )
    limit: int | None = opt(None, "Replay only the first N requests.", type=click.IntRange(1))
    slab_size_mb: int = opt(
        64,
        "Server slab size (capacity is whole slabs of whole objects).",
        type=click.IntRange(1, 4096),
    )
    geometry: GeometryArgs = GeometryArgs()
    show_progress: bool = True


def _ratio(hits: list[int], requests: list[TraceRequest]) -> float:
    total = sum(r.input_tokens for r in requests)
    return sum(hits) * CHUNK_TOKENS / total if total else float("nan")


def _replay(
    endpoint: str, requests: list[TraceRequest], kv: Any, bar: Any
) -> tuple[list[int], StatsReport]:
    """Drive one server through the trace; hit chunks per request and final stats."""
    geometry = kv
    hits = []
    with Client(endpoint, timeout_s=120, client_name="lmcache-bench-replay") as c:
        buffers = [
            ShmBuffer(name=f"lmc-null-{i}", size_bytes=s)
            for i, s in enumerate(geometry.buffer_sizes)
        ]
        reg = c.register(
            model=geometry.model,
            kv_dtype=geometry.kv_dtype,
            arch=geometry.arch,
            groups=geometry.groups,
            buffers=buffers,
        )
        bpc = {g.name: blocks_per_chunk(g, CHUNK_TOKENS) for g in geometry.groups if g.cached}
        for i, r in enumerate(requests):
            n = r.n_chunks
            if n == 0:
                hits.append(0)
                continue
            res = c.lookup(reg, r.digests, lease=True)
            h = res.hit_chunks
            hits.append(h)
            if h < n:
                ids = {name: np.arange((n - h) * b, dtype=np.int32) for name, b in bpc.items()}
                c.store(reg, r.digests[32 * h :], ids)
            if res.lease_id:
                c.release(res.lease_id)
            if i % 256 == 255:
                bar.update(256)
        bar.update(len(requests) % 256)
        stats = c.stats()
    return hits, stats


def run(cfg: ReplayConfig) -> Report:
    requests = load_trace(cfg.trace, cfg.limit)
    chunks, distinct = chunk_ids(requests)
    max_chunks = max((len(c) for c in chunks), default=1) or 1
    probe = cfg.geometry.build(1)
    max_bpc = max(blocks_per_chunk(g, CHUNK_TOKENS) for g in probe.groups if g.cached)
    geometry = cfg.geometry.build(max(1, max_chunks * max_bpc))
    object_bytes = build_layout(geometry.groups, CHUNK_TOKENS, False).chunk_bytes
    slab_bytes = cfg.slab_size_mb * MIB
    if object_bytes > slab_bytes:
        raise ValueError(
            f"a chunk is {object_bytes} bytes, more than a "
            f"{cfg.slab_size_mb} MiB slab: raise --slab-size-mb"
        )
    slots_per_slab = slab_bytes // slot_stride(object_bytes, slab_bytes)
    distinct_bytes = distinct * object_bytes
    inf = infinite_hits(chunks)
    inf_ratio = _ratio(inf, requests)
    report = Report(
        "replay",
        {
            "trace": cfg.trace,
            "requests": len(requests),
            "limit": cfg.limit,
            "input_tokens": sum(r.input_tokens for r in requests),
            "chunk_refs": sum(len(c) for c in chunks),
            "distinct_chunks": distinct,
            "geometry": cfg.geometry.describe(),
            "chunk_size": CHUNK_TOKENS,
            "object_bytes": object_bytes,
            "distinct_bytes": distinct_bytes,
            "slab_size_mb": cfg.slab_size_mb,
            "slots_per_slab": slots_per_slab,
            "backend": "null",
            "object_groups": "combined",
            "fractions": list(cfg.fractions),
            "policies": list(cfg.policies),
        },
    )
    report.summary["infinite_ratio"] = inf_ratio
    hows = set()
    with progress(
        len(requests) * len(cfg.fractions) * len(cfg.policies), "replay", cfg.show_progress
    ) as bar:
        for frac in cfg.fractions:
            n_slabs = max(1, int(frac * distinct_bytes // slab_bytes))
            capacity = n_slabs * slots_per_slab
            l1_size_gb = n_slabs * slab_bytes / GIB
            bel_ratio = _ratio(belady_hits(chunks, capacity), requests)
            for policy in cfg.policies:
                with server(
                    ["--metrics-port", "0"],
                    backend="null",
                    l1_size_gb=l1_size_gb,
                    slab_size_mb=cfg.slab_size_mb,
                    chunk_size=CHUNK_TOKENS,
                    separate=False,
                    eviction_policy=policy,
                    allow_thread=True,
                ) as (srv, how):
                    hits, stats = _replay(srv.endpoint, requests, geometry, bar)
                hows.add(how)
                parts = stats.partitions
                served = stats.counters.hit_tokens
                report.rows.append(
                    {
                        "fraction": frac,
                        "actual_fraction": capacity / distinct if distinct else 0,
                        "l1_size_gb": l1_size_gb,
                        "capacity_objects": capacity,
                        "server_capacity_objects": sum(p.capacity_objects for p in parts),
                        "policy": policy,
                        "hit_ratio": _ratio(hits, requests),
                        "belady_ratio": bel_ratio,
                        "infinite_ratio": inf_ratio,
                        "server_hit_tokens": served,
                        "evictions": stats.counters.evictions,
                        "no_space": stats.counters.alloc_failures.get("no_space", 0),
                    }
                )
    report.notes += [
        "backend null: the server does all bookkeeping (index, leases, eviction) but copies "
        "no bytes; bytes per chunk come from the geometry "
        f"({object_bytes} B/chunk, {cfg.geometry.describe()})",
        "per request: lookup with a lease, store of the chunks after the hit prefix, release",
        f"server: {'; '.join(sorted(hows))}",
        "bounds use the same capacity in objects as the server; Belady = offline MIN "
        "(farthest next use evicted first, incoming chunks included)",
    ]
    return report


def table(report: Report) -> str:
    """One line per capacity: requested and actual fraction of the distinct chunk bytes
    (whole slabs of whole objects: the actual one is what the server and the bounds
    had), then every policy's token hit ratio side by side with Belady and infinite."""
    c = report.config
    head = (
        f"{c['requests']} requests, {c['input_tokens']} input tokens, "
        f"{c['chunk_refs']} chunk references, {c['distinct_chunks']} distinct chunks "
        f"({c['distinct_bytes'] / GIB:.1f} GiB at {c['object_bytes']} B/chunk)\n"
    )
    policies = list(c["policies"])
    lines = []
    for frac in sorted({r["fraction"] for r in report.rows}):
        rs = [r for r in report.rows if r["fraction"] == frac]
        line: dict[str, Any] = {
            "fraction": frac,
            "actual_fraction": rs[0]["actual_fraction"],
            "l1_size_gb": rs[0]["l1_size_gb"],
            "capacity_objects": rs[0]["capacity_objects"],
            "belady_ratio": rs[0]["belady_ratio"],
            "infinite_ratio": rs[0]["infinite_ratio"],
        }
        for r in rs:
            line[r["policy"]] = r["hit_ratio"]
        lines.append(line)
    columns = "fraction|requested|.2f; actual_fraction|actual|.4f; l1_size_gb|L1 GiB|.1f; "
    columns += "capacity_objects|objects|d; " + "".join(f"{p}|{p}|.4f; " for p in policies)
    columns += "belady_ratio|Belady|.4f; infinite_ratio|infinite|.4f"
    return head + format_table(lines, columns)


def plot(report: Report, path: str) -> None:
    from lmc_server.bench.common import plot_figure, save_figure

    fig, ax = plot_figure()
    fracs = sorted({r["actual_fraction"] for r in report.rows})
    for policy in report.config["policies"]:
        rs = sorted(
            (r for r in report.rows if r["policy"] == policy), key=lambda r: r["actual_fraction"]
        )
        ax.plot(
            [r["actual_fraction"] for r in rs],
            [r["hit_ratio"] for r in rs],
            "o-",
            label=f"server {policy}",
        )
    bel = {r["actual_fraction"]: r["belady_ratio"] for r in report.rows}
    ax.plot(fracs, [bel[f] for f in fracs], "k--", label="Belady (offline optimum)")
    ax.axhline(
        report.summary["infinite_ratio"], color="gray", linestyle=":", label="infinite cache"
    )
    ax.set_xscale("log")
    ax.set_xlabel("L1 size / distinct chunk bytes of the trace (actual, whole slabs)")
    ax.set_ylabel("token hit ratio")
    name = os.path.basename(report.config["trace"])
    ax.set_title(f"lmcache bench replay: {name} ({report.config['requests']} requests)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    save_figure(fig, path)
