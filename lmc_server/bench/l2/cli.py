"""``lmcache bench l2``: the click command (options into its config, run, report)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import click

from lmc_server.bench import extras
from lmc_server.bench.common import GeometryArgs, emit
from lmc_server.bench.options import (
    geometry_options,
    ints,
    json_option,
    no_progress_option,
)
from lmc_server.config import Config


@click.command("l2")
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
    "--l2-connections",
    type=click.IntRange(1, 16),
    default=Config().l2_connections,
    help="The servers' --l2-connections [default: the server's own].",
)
@click.option(
    "--redis-io-threads",
    type=click.IntRange(1, 64),
    default=1,
    help="Start the redis-server with this many I/O threads (--io-threads N "
    "--io-threads-do-reads yes); not with --redis-url.",
)
@click.option(
    "--redis-server",
    "redis_server",
    default="",
    help="The server binary to start: redis-server or valkey-server, a name on PATH "
    "or a path [default: redis-server]; not with --redis-url.",
)
@click.option(
    "--redis-cluster-nodes",
    type=click.IntRange(0, 16),
    default=0,
    help="Start a Redis Cluster of this many primaries on loopback (each with "
    "--redis-io-threads, from --redis-server) and run the servers on "
    "--l2 redis+cluster://...; not with --redis-url [default: 0, one store].",
)
@click.option(
    "--warm-store-gb",
    type=click.FloatRange(min=0),
    default=None,
    help="Write this much to the store the bench starts, and flush it, before timing: "
    "a store that has served a while, not one that just started (0: the cold store) "
    "[default: 2]; not with --redis-url (never flushed).",
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
    "--flood-chunks",
    type=click.IntRange(0),
    default=512,
    help="--disk-dir: chunks stored back to back (and then paced below the disk's "
    "rate) to count what of the committed objects the write-behind writes (0: skip).",
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
@no_progress_option
def l2(
    chunks: int,
    rounds: int,
    latency_chunks: tuple[int, ...],
    repeats: int,
    l1_size_gb: float,
    redis_url: str,
    l2_connections: int,
    redis_io_threads: int,
    redis_server: str,
    redis_cluster_nodes: int,
    warm_store_gb: float | None,
    disk_dir: str,
    restart_gb: float,
    flood_chunks: int,
    trace_path: str | None,
    replay_tier: str,
    limit: int,
    l1_fraction: float,
    l2_fraction: float,
    json_path: str | None,
    no_progress: bool,
    **geometry: Any,
) -> None:
    """L2 (Redis) GB/s and objects/s through two servers vs redis-py on the same bytes."""
    if redis_io_threads > 1 and redis_url:
        raise click.UsageError(
            "--redis-io-threads starts a redis-server; set io-threads on the one at --redis-url"
        )
    if redis_cluster_nodes and redis_url:
        raise click.UsageError("--redis-cluster-nodes starts a cluster; not with --redis-url")
    if redis_server and redis_url:
        raise click.UsageError("--redis-server starts a server; not with --redis-url")
    if warm_store_gb and redis_url:
        raise click.UsageError(
            "--warm-store-gb flushes the store it warms; it only warms one the bench "
            "starts, never the one at --redis-url"
        )
    if redis_server and shutil.which(redis_server) is None:
        raise click.BadParameter(
            f"{redis_server!r} is not an executable", param_hint="--redis-server"
        )
    if trace_path is not None:
        from lmc_server.bench.l2 import replay as l2replay

        if replay_tier != "disk":
            extras.require("redis", "lmcache bench l2 --replay with the Redis tier")

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
                show_progress=not no_progress,
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
                flood_chunks=flood_chunks,
                geometry=GeometryArgs.pop(geometry),
                l1_size_gb=l1_size_gb,
            )
        )
        emit(report, l2disk.table(report), json_path)
        if report.summary["mismatched_groups"] or not report.summary["retrieved_ok"]:
            raise SystemExit(1)
        return
    extras.require("redis", "lmcache bench l2 (the Redis tier; --disk-dir for the disk tier)")
    from lmc_server.bench.l2 import run as l2b

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
            redis_io_threads=redis_io_threads,
            redis_server=(shutil.which(redis_server) or "") if redis_server else "",
            cluster_nodes=redis_cluster_nodes,
            warm_store_gb=(
                l2b.L2BenchConfig.warm_store_gb if warm_store_gb is None else warm_store_gb
            ),
        )
    )
    emit(report, l2b.table(report), json_path)
    if report.summary["mismatched_groups"] or not report.summary["retrieved_ok"]:
        raise SystemExit(1)
