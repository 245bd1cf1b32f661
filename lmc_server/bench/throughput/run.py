"""``lmcache bench throughput``: store/retrieve bandwidth of a real server vs a raw copy.

For each batch size (chunks per request) the benchmark times, through a real server
process and the asyncio client:

- ``store``: fresh digests every request (so every chunk is copied), alternating
  between two source regions of different random contents;
- ``retrieve``: alternately the last batch stored from each source, into a third
  region; after every request the written blocks are compared byte for byte with the
  source (mismatches must be 0);
- ``store+retrieve`` (on by default for cuda): one store and one retrieve in flight
  at once, the figure over the bytes of both.
- ``store xN`` / ``retrieve xN`` (``--inflight N``): sustained throughput with N
  requests kept in flight, GB/s over the wall time of the whole run; with
  ``--concurrent``, ``store+retrieve xN``: N stores and N retrieves in flight at once,
  against the raw copy in both directions at once.

Bytes are what the server moves: a store copies whole objects, a retrieve copies the
full-prefix sections of every chunk but sliding-window sections only for the chunks in
the window. The raw copy of the same bytes (:mod:`lmc_server.bench.baselines.rawcopy`) is timed in
the same run; ``ratio`` is ours / raw.

Each row also says where the time went inside the server: the mean per request of the
server's phases (``stats`` ``phases``: queue, prepare, submit, copy, hop_out, finish,
docs/protocol.md) over the timed requests. ``srv ms`` is their sum and ``copy ms`` the
engine call; the rest of ``p50 ms`` is the client, the sockets and the wake-ups between
them. The timing loops are in :mod:`.timing`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lmc_server.bench.common import GeometryArgs, Report, format_table, progress
from lmc_server.bench.kvregions import Regions, max_blocks_per_chunk
from lmc_server.bench.servers import server_flags
from lmc_server.bench.throughput.config import ThroughputConfig
from lmc_server.bench.throughput.timing import Raw, Session, measure_batch
from lmc_server.client.aio import AsyncClient
from lmc_server.testing.process import ServerProcess


@contextmanager
def _kv(cfg: ThroughputConfig, num_blocks: int) -> Iterator[Any]:
    geometry = cfg.geometry.build(num_blocks)
    if cfg.backend == "cuda":
        from lmc_server.testing.cuda_kv import CudaKV, device_arch  # type: ignore[import-not-found, unused-ignore]

        arch = device_arch(cfg.device)
        if arch != geometry.arch:
            geometry = GeometryArgs(**{**cfg.geometry.__dict__, "arch": arch}).build(num_blocks)
        with CudaKV(geometry, device=cfg.device) as kv:
            yield kv
    else:
        from lmc_server.testing.kv import ShmKV

        with ShmKV(geometry) as kv:
            yield kv


async def _run_server(
    endpoint: str, kv: Any, cfg: ThroughputConfig, copy_mode: str, raw: Raw, bar: Any
) -> list[dict[str, Any]]:
    client = await AsyncClient.connect(endpoint, timeout_s=120, client_name="lmcache-bench")
    try:
        reg = await client.register(**kv.register_kwargs())
        regions = Regions.build(kv.geometry, reg.chunk_size, max(cfg.batches), cfg.separate)
        s = Session(client, reg, kv, regions)
        rows = []
        for n in cfg.batches:
            rows += await measure_batch(s, n, cfg, copy_mode, raw)
            bar.update(1)
        await client.unregister(reg)
        return rows
    finally:
        await client.close()


def run(cfg: ThroughputConfig) -> Report:
    max_batch = max(cfg.batches)
    probe = cfg.geometry.build(1)
    num_blocks = 3 * max_batch * max_blocks_per_chunk(probe, cfg.chunk_size)
    modes = cfg.copy_modes if cfg.backend == "cuda" else ("-",)
    report = Report(
        "throughput",
        {
            "backend": cfg.backend,
            "batches": list(cfg.batches),
            "geometry": cfg.geometry.describe(),
            "chunk_size": cfg.chunk_size,
            "separate_object_groups": cfg.separate,
            "l1_size_gb": cfg.l1_size_gb,
            "copy_modes": list(modes),
            "concurrent": cfg.concurrent,
            "min_time_s": cfg.min_time_s,
            "min_iters": cfg.min_iters,
        },
    )
    with _kv(cfg, num_blocks) as kv:
        kv.fill_random(cfg.seed)
        regions = Regions.build(kv.geometry, cfg.chunk_size, max_batch, cfg.separate)
        report.config["chunk_bytes"] = regions.layout.chunk_bytes
        report.config["arch"] = kv.geometry.arch
        raw = Raw(cfg, regions.store_bytes(max_batch))
        try:
            with progress(len(modes) * len(cfg.batches), "throughput", cfg.show_progress) as bar:
                for mode in modes:
                    copy_mode = mode if cfg.backend == "cuda" else ""
                    args = server_flags(cfg.chunk_size, cfg.separate, copy_mode=copy_mode)
                    with ServerProcess(args, backend=cfg.backend, l1_size_gb=cfg.l1_size_gb) as srv:
                        srv.wait_pool_ready()  # time a ready server, not one still pinning
                        report.rows += asyncio.run(
                            _run_server(srv.endpoint, kv, cfg, mode, raw, bar)
                        )
        finally:
            raw.close()
    report.summary = {
        "mismatched_bytes": sum(r["mismatched_bytes"] for r in report.rows),
        "failed_chunks": sum(r["failed_chunks"] for r in report.rows),
        "min_ratio": {
            m: min(r["ratio"] for r in report.rows if r["mode"] == m)
            for m in sorted({r["mode"] for r in report.rows})
        },
    }
    raw_what = (
        "pinned cudaMemcpy (testing.cuda_kv.raw_copy_gbps)"
        if cfg.backend == "cuda"
        else "one numpy.copyto between a /dev/shm segment and populated anonymous "
        "memory, single thread, timed right after each server request"
    )
    report.notes += [
        f"raw = {raw_what}, same byte count, timed in this run; ratio = ours / raw",
        "retrieve bytes: full-prefix sections of every chunk, sliding-window sections "
        "only for the chunks in the window (what the server copies)",
        "every retrieve whose chunks all succeeded is compared byte for byte with its "
        "source: "
        f"{report.summary['mismatched_bytes']} mismatched bytes, "
        f"{report.summary['failed_chunks']} failed chunks",
    ]
    return report


COLUMNS = (
    "mode|mode; copy_mode|copy; chunks|chunks|d; bytes|MB; p50_ms|p50 ms|.2f; "
    "ours_gbps|ours GB/s|.2f; raw_gbps|raw GB/s|.2f; ratio|ours/raw|.2f; "
    "srv_ms|srv ms|.2f; copy_ms|copy ms|.2f; mismatched_bytes|mismatch B|d; "
    "failed_chunks|failed|d"
)


def table(report: Report) -> str:
    rows = [{**r, "bytes": f"{r['bytes'] / 1e6:.1f}"} for r in report.rows]
    return format_table(rows, COLUMNS)


def plot(report: Report, path: str) -> None:
    from lmc_server.bench.common import plot_figure, save_figure

    fig, ax = plot_figure()
    keys = sorted({(r["mode"], r["copy_mode"]) for r in report.rows})
    for mode, copy in keys:
        rs = [r for r in report.rows if r["mode"] == mode and r["copy_mode"] == copy]
        label = mode if copy == "-" else f"{mode} ({copy})"
        line = ax.plot(
            [r["chunks"] for r in rs], [r["ours_gbps"] for r in rs], "o-", label=f"ours: {label}"
        )[0]
        ax.plot(
            [r["chunks"] for r in rs],
            [r["raw_gbps"] for r in rs],
            "--",
            color=line.get_color(),
            alpha=0.6,
            label=f"raw: {label}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunks per request")
    ax.set_ylabel("GB/s")
    ax.set_title(
        f"lmcache bench throughput ({report.config['backend']}, "
        f"{report.config['chunk_bytes'] / 1e6:.2f} MB/chunk)"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)
