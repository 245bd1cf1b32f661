"""``lmcache bench``: click commands that build a benchmark config, run it, report.

Each command only parses options into its benchmark's config dataclass, calls
``run``, then prints the table, writes ``--json`` and draws ``--plot``; the
measuring lives in the benchmark modules.
"""

from __future__ import annotations

import os
from typing import Any

import click

from lmc_server.bench.common import GeometryArgs, emit
from lmc_server.bench.options import (
    backend_option,
    copy_modes_option,
    device_option,
    floats,
    geometry_options,
    ints,
    json_option,
    names,
    output_options,
    parse_floats,
    plot_option,
)


@click.group(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "show_default": True,
        "max_content_width": 100,
    }
)
def bench() -> None:
    """Measure the server on this machine against this machine's own limits."""


@bench.command()
@backend_option("Transfer engine of the server (and kind of KV memory).")
@click.option(
    "--batches",
    default="1,2,4,8,16,32,64",
    callback=ints,
    help="Chunks per request, comma-separated.",
)
@geometry_options
@click.option(
    "--l1-size-gb",
    type=click.FloatRange(min=0.1),
    default=2.0,
    help="Server pool size (must hold three of the largest batches).",
)
@click.option(
    "--separate-object-groups/--no-separate-object-groups",
    "separate",
    default=True,
    help="Server object-group layout.",
)
@copy_modes_option(
    "cuda only: copy modes to measure, comma-separated (one server each); "
    "staging:N also sets --cuda-staging-mb N."
)
@click.option(
    "--concurrent/--no-concurrent",
    default=None,
    help="Also time a store and a retrieve in flight at once [default: on for cuda].",
)
@click.option(
    "--inflight",
    default="1,2",
    callback=ints,
    help="Also time sustained throughput with N requests of the same kind "
    "kept in flight (a new one as soon as one completes, as a pipelining "
    "engine does), for each N > 1 of a comma-separated list; 1: single "
    "requests only.",
)
@click.option(
    "--min-time-s",
    type=click.FloatRange(min=0),
    default=0.5,
    help="Least time spent timing each (mode, batch) point.",
)
@click.option(
    "--min-iters", type=click.IntRange(1), default=3, help="Least requests timed per point."
)
@device_option
@output_options
def throughput(
    backend: str,
    batches: tuple[int, ...],
    l1_size_gb: float,
    separate: bool,
    copy_modes: tuple[str, ...],
    concurrent: bool | None,
    inflight: tuple[int, ...],
    min_time_s: float,
    min_iters: int,
    device: int,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
    **geometry: Any,
) -> None:
    """Store and retrieve GB/s through a real server vs a raw copy of the same bytes."""
    from lmc_server.bench.throughput import run as tp

    cfg = tp.ThroughputConfig(
        backend=backend,
        batches=batches,
        geometry=GeometryArgs.pop(geometry),
        l1_size_gb=l1_size_gb,
        separate=separate,
        copy_modes=copy_modes,
        concurrent=backend == "cuda" if concurrent is None else concurrent,
        inflight=tuple(k for k in inflight if k > 1),
        min_time_s=min_time_s,
        min_iters=min_iters,
        device=device,
        show_progress=not no_progress,
    )
    report = tp.run(cfg)
    emit(report, tp.table(report), json_path)
    if plot_path:
        tp.plot(report, plot_path)
    if report.summary["mismatched_bytes"] or report.summary["failed_chunks"]:
        raise SystemExit(1)


@bench.command()
@click.option(
    "--clients", default="1,8,64", callback=ints, help="Concurrent clients, comma-separated."
)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=0.01),
    default=1.0,
    help="Seconds timed per (operation, clients) point, ours and echo each.",
)
@output_options
def latency(
    clients: tuple[int, ...],
    duration_s: float,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
) -> None:
    """Round trips (p50, p99) and ops/s of ping, lookup and store/retrieve vs pyzmq echo."""
    from lmc_server.bench import latency as lat

    report = lat.run(
        lat.LatencyConfig(clients=clients, duration_s=duration_s, show_progress=not no_progress)
    )
    emit(report, lat.table(report), json_path)
    if plot_path:
        lat.plot(report, plot_path)


@bench.command()
@backend_option("Transfer engine of the server.")
@click.option(
    "--l1-size-gb",
    "sizes",
    default=None,
    callback=lambda c, p, v: None if v is None else tuple(parse_floats(v)),
    help="Pool sizes in GiB, comma-separated [default: 1,16; 1,16,100 on cuda].",
)
@click.option("--repeats", type=click.IntRange(1), default=3, help="Cold starts per size.")
@output_options
def startup(
    backend: str,
    sizes: tuple[float, ...] | None,
    repeats: int,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
) -> None:
    """Seconds from process start until ping answers and until the pool is ready."""
    from lmc_server.bench import startup as st

    if sizes is None:
        sizes = (1.0, 16.0, 100.0) if backend == "cuda" else (1.0, 16.0)
    report = st.run(
        st.StartupConfig(
            backend=backend, sizes_gb=sizes, repeats=repeats, show_progress=not no_progress
        )
    )
    emit(report, st.table(report), json_path)
    if plot_path:
        st.plot(report, plot_path)


@bench.command()
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False),
    required=True,
    help="Trace file (JSON lines: timestamp, input_length, hash_ids).",
)
@click.option(
    "--fractions",
    default="0.01,0.05,0.1,0.25,0.5",
    callback=floats,
    help="L1 sizes as fractions of the trace's distinct chunk bytes.",
)
@click.option(
    "--policies", default="LRU,FIFO,ARC,S3FIFO,SARC", help="Eviction policies, comma-separated."
)
@click.option(
    "--limit", type=click.IntRange(1), default=None, help="Replay only the first N requests."
)
@click.option(
    "--slab-size-mb",
    type=click.IntRange(1, 4096),
    default=64,
    help="Server slab size (capacity is whole slabs of whole objects).",
)
@geometry_options
@output_options
def replay(
    trace_path: str,
    fractions: tuple[float, ...],
    policies: str,
    limit: int | None,
    slab_size_mb: int,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
    **geometry: Any,
) -> None:
    """Token hit ratio per eviction policy on a trace vs infinite-cache and Belady bounds."""
    from lmc_server.bench.traces import replay as rp
    from lmc_server.cache.eviction import POLICIES

    names = tuple(p.strip().upper() for p in policies.split(",") if p.strip())
    bad = set(names) - set(POLICIES)
    if bad or not names:
        raise click.BadParameter(f"choose from {', '.join(POLICIES)}", param_hint="--policies")
    report = rp.run(
        rp.ReplayConfig(
            trace=trace_path,
            fractions=fractions,
            policies=names,
            geometry=GeometryArgs.pop(geometry),
            slab_size_mb=slab_size_mb,
            limit=limit,
            show_progress=not no_progress,
        )
    )
    emit(report, rp.table(report), json_path)
    if plot_path:
        rp.plot(report, plot_path)


@bench.command()
@click.option(
    "--mode",
    type=click.Choice(["tp", "dp"]),
    default="tp",
    help="tp: the tensor-parallel ranks of one engine (replicated KV; phases 1-3 "
    "and the TP phases). dp: independent data-parallel engines, each rank 0 of "
    "world size 1 (one namespace), storing their own prompts and loading "
    "prefixes any engine stored, at their own pace (the DP phase, phase 3).",
)
@backend_option("Transfer engine of the server; cuda: ranks round-robin over the GPUs.")
@click.option(
    "--ranks",
    type=click.IntRange(1, 256),
    default=8,
    help="Worker processes, one registration each (TP ranks, or DP engines).",
)
@click.option(
    "--chunks",
    type=click.IntRange(1),
    default=1000,
    help="Chunks rank 0 stores in phase 1 (and slots of each KV region).",
)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=0.1),
    default=60.0,
    help="Seconds of concurrent store/retrieve on every rank (phase 2; the DP "
    "phase with --mode dp).",
)
@click.option(
    "--kill-one/--no-kill-one",
    default=True,
    help="SIGKILL the last rank halfway through phase 2 or the DP phase (phase 3).",
)
@geometry_options
@click.option(
    "--num-blocks",
    type=click.IntRange(1),
    default=None,
    help="Blocks per KV group [default: the least two regions of --chunks need].",
)
@click.option(
    "--batch",
    type=click.IntRange(1),
    default=16,
    help="Chunks per request in phase 1 stores and phase 2; with --mode dp, "
    "chunks per prompt (each store, and the longest load).",
)
@click.option(
    "--l1-size-gb",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Server pool [default: twice the phase-1 bytes plus 1 GiB].",
)
@click.option(
    "--verify-every",
    type=click.IntRange(1),
    default=8,
    help="Phase 2: compare every n-th successful retrieve byte for byte (DP "
    "mode compares every load).",
)
@click.option(
    "--raw-s",
    type=click.FloatRange(min=0.01),
    default=1.0,
    help="Seconds of each raw-copy baseline direction.",
)
@click.option(
    "--tp-modes",
    default="load,mixed",
    show_default=True,
    help="Steady-state TP phases, comma-separated: load (every rank retrieves the "
    "same prefix at once), mixed (and rank 0 stores meanwhile); '' for none.",
)
@click.option(
    "--tp-s",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds each TP phase runs.",
)
@click.option(
    "--tp-chunks",
    type=click.IntRange(1),
    default=None,
    help="Chunks per TP request (the prefix length) [default: --batch].",
)
@click.option(
    "--tp-inflight",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Requests each rank keeps in flight in the TP phases.",
)
@json_option
@plot_option("Write a PNG plot here (GB/s per rank or engine).")
def ranks(
    mode: str,
    backend: str,
    ranks: int,
    chunks: int,
    duration_s: float,
    kill_one: bool,
    num_blocks: int | None,
    batch: int,
    l1_size_gb: float | None,
    verify_every: int,
    raw_s: float,
    json_path: str | None,
    plot_path: str | None,
    tp_modes: str,
    tp_s: float,
    tp_chunks: int | None,
    tp_inflight: int,
    **geometry: Any,
) -> None:
    """Ranks of one engine (TP) or independent engines (DP) on one server: bytes, GB/s,
    a dead rank."""
    from lmc_server.bench.ranks import run as rk
    from lmc_server.bench.ranks.config import RanksConfig
    from lmc_server.bench.ranks.table import table

    cfg = RanksConfig(
        mode=mode,
        backend=backend,
        ranks=ranks,
        chunks=chunks,
        duration_s=duration_s,
        kill_one=kill_one,
        geometry=GeometryArgs.pop(geometry),
        num_blocks=num_blocks,
        batch=min(batch, chunks),
        l1_size_gb=l1_size_gb,
        verify_every=verify_every,
        raw_s=raw_s,
        tp_modes=tuple(m for m in tp_modes.split(",") if m),
        tp_s=tp_s,
        tp_chunks=tp_chunks,
        tp_inflight=tp_inflight,
    )
    try:
        report = rk.run(cfg)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    emit(report, table(report), json_path)
    if plot_path:
        from lmc_server.bench.ranks.plot import plot

        plot(report, plot_path)
    if not report.summary["ok"]:
        raise SystemExit(1)


@bench.command("l2")
@click.option(
    "--chunks",
    type=click.IntRange(1, 4096),
    default=64,
    help="Chunks per throughput round (store on A, L2 read on B).",
)
@click.option("--rounds", type=click.IntRange(1), default=3, help="Throughput rounds.")
@click.option(
    "--latency-chunks",
    default="1,16,64",
    callback=ints,
    help="Chunks of the L1-miss-L2-hit latency points, comma-separated.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=5,
    help="Timings per latency point (median reported).",
)
@click.option(
    "--l1-size-gb",
    type=click.FloatRange(min=0.1),
    default=1.0,
    help="Pool of each of the two servers.",
)
@click.option(
    "--redis-url",
    default="",
    help="An existing Redis/Valkey to use [default: start a redis-server on a free loopback port].",
)
@click.option(
    "--l2-connections", type=click.IntRange(1, 16), default=1, help="The servers' --l2-connections."
)
@click.option(
    "--disk-dir",
    default="",
    help="Instead: the disk tier on this directory "
    "(two servers sharing it) vs plain os.pwrite/os.preadv there, and a restart.",
)
@click.option(
    "--restart-gb",
    type=click.FloatRange(min=0),
    default=2.0,
    help="--disk-dir: fill the directory to this much before the restart run.",
)
@click.option(
    "--replay",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Instead: replay this trace (as 'bench replay') with L1 "
    "alone and with L1 + L2; token hit ratio per tier. Uses a 2-layer geometry "
    "unless --layers is given.",
)
@click.option(
    "--replay-tier",
    type=click.Choice(["l2", "disk"]),
    default="l2",
    help="--replay: the lower tier, Redis (l2) or the disk tier on a temporary "
    "directory (disk: adds the model of the three disk write policies).",
)
@click.option(
    "--limit",
    type=click.IntRange(1),
    default=1000,
    help="--replay: the first N requests of the trace.",
)
@click.option(
    "--l1-fraction",
    type=click.FloatRange(min=0, min_open=True),
    default=0.05,
    help="--replay: L1 size as a fraction of the replayed distinct chunk bytes.",
)
@click.option(
    "--l2-fraction",
    type=click.FloatRange(min=0, min_open=True),
    default=0.5,
    help="--replay: L2 maxmemory as a fraction of the distinct chunk bytes.",
)
@geometry_options
@json_option
def l2(
    chunks: int,
    rounds: int,
    latency_chunks: tuple[int, ...],
    repeats: int,
    l1_size_gb: float,
    redis_url: str,
    l2_connections: int,
    disk_dir: str,
    restart_gb: float,
    trace_path: str | None,
    replay_tier: str,
    limit: int,
    l1_fraction: float,
    l2_fraction: float,
    json_path: str | None,
    **geometry: Any,
) -> None:
    """L2 (Redis) GB/s and objects/s through two servers vs redis-py on the same bytes."""
    from lmc_server.bench.l2 import run as l2b

    if trace_path is not None:
        from lmc_server.bench.l2 import replay as l2replay

        src = click.get_current_context().get_parameter_source("layers")
        geo = GeometryArgs.pop(geometry)
        if src is not None and src.name == "DEFAULT":
            geo = GeometryArgs(**{**geo.__dict__, "layers": 2, "sliding_groups": 1})
        rep = l2replay.run(
            l2replay.L2ReplayConfig(
                trace=trace_path,
                limit=limit,
                l1_fraction=l1_fraction,
                l2_fraction=l2_fraction,
                geometry=geo,
                disk=replay_tier == "disk",
            )
        )
        emit(rep, l2replay.table(rep), json_path)
        return
    if disk_dir:
        from lmc_server.bench.l2 import disk as l2disk

        report = l2disk.run(
            l2disk.DiskBenchConfig(
                disk_dir=os.path.abspath(disk_dir),
                chunks=chunks,
                rounds=rounds,
                latency_chunks=latency_chunks,
                repeats=repeats,
                restart_gb=restart_gb,
                geometry=GeometryArgs.pop(geometry),
                l1_size_gb=l1_size_gb,
            )
        )
        emit(report, l2disk.table(report), json_path)
        if report.summary["mismatched_groups"] or not report.summary["retrieved_ok"]:
            raise SystemExit(1)
        return
    report = l2b.run(
        l2b.L2BenchConfig(
            chunks=chunks,
            rounds=rounds,
            latency_chunks=latency_chunks,
            repeats=repeats,
            geometry=GeometryArgs.pop(geometry),
            l1_size_gb=l1_size_gb,
            redis_url=redis_url,
            l2_connections=l2_connections,
        )
    )
    emit(report, l2b.table(report), json_path)
    if report.summary["mismatched_groups"] or not report.summary["retrieved_ok"]:
        raise SystemExit(1)


@bench.command()
@click.option(
    "--engines",
    default="gemm,hbm",
    callback=names(("gemm", "hbm", "decode"), "--engines"),
    help="Engine workloads beside the server: gemm (bf16 8192^3 matmuls), hbm "
    "(1 GiB device copies), decode (a CUDA graph of small kernels).",
)
@copy_modes_option(
    "Server copy modes, comma-separated (one server each); staging:N also sets --cuda-staging-mb N."
)
@click.option(
    "--ops",
    default="store,retrieve,both",
    callback=names(("store", "retrieve", "both"), "--ops"),
    help="Server loops: store, retrieve (lookup + retrieve + release), both.",
)
@click.option("--chunks", default="64", callback=ints, help="Chunks per request.")
@click.option(
    "--inflight",
    default="1,2",
    callback=ints,
    help="Requests of each kind kept in flight, comma-separated.",
)
@click.option(
    "--seconds", type=click.FloatRange(min=0.2), default=1.5, help="Length of each measured window."
)
@click.option(
    "--own-copy/--no-own-copy",
    default=True,
    help="Also measure the engine's own side-stream copy of the same bytes.",
)
@geometry_options
@click.option("--l1-size-gb", type=click.FloatRange(min=0.5), default=4.0, help="Server pool size.")
@click.option(
    "--block-order",
    type=click.Choice(["consecutive", "random"]),
    default="consecutive",
    help="Block ids of a request: consecutive (a fresh engine) or a random "
    "permutation (an engine's block pool after churn).",
)
@device_option
@output_options
def interference(
    engines: tuple[str, ...],
    copy_modes: tuple[str, ...],
    ops: tuple[str, ...],
    chunks: tuple[int, ...],
    inflight: tuple[int, ...],
    seconds: float,
    own_copy: bool,
    l1_size_gb: float,
    block_order: str,
    device: int,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
    **geometry: Any,
) -> None:
    """The server's GB/s and the engine's loss with an engine computing on the same GPU."""
    from lmc_server.bench.interference import run as itf

    report = itf.run(
        itf.InterferenceConfig(
            engines=engines,
            copy_modes=copy_modes,
            ops=ops,
            chunks=chunks,
            inflight=inflight,
            seconds=seconds,
            own_copy=own_copy,
            geometry=GeometryArgs.pop(geometry),
            l1_size_gb=l1_size_gb,
            block_order=block_order,
            device=device,
            show_progress=not no_progress,
        )
    )
    emit(report, itf.table(report), json_path)
    if plot_path:
        itf.plot(report, plot_path)
    if report.summary["mismatched_bytes"] or report.summary["failed_chunks"]:
        raise SystemExit(1)
