"""The settings of ``lmcache bench l2``, read by its three runs: the Redis run
(:mod:`.run`), the disk tier's (:mod:`.disk`) and the trace replay (:mod:`.replay`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import click

from lmc_server.bench.common import DEFAULT_CHUNK_SIZE, GeometryArgs
from lmc_server.bench.options import ints, opt
from lmc_server.config import Config

#: What a store the bench starts is warmed with, unless ``--warm-store-gb`` says.
WARM_STORE_GB = 2.0


@dataclass(frozen=True)
class L2Config:
    """The settings of ``lmcache bench l2``: the Redis run (:mod:`.run`), the disk tier's
    (``disk_dir``, :mod:`.disk`) and the trace replay (``trace``, :mod:`.replay`)
    each read the fields that concern them."""

    chunks: int = opt(
        64,
        "Chunks per throughput round (store on A, L2 read on B).",
        type=click.IntRange(1, 4096),
    )
    rounds: int = opt(3, "Throughput rounds.", type=click.IntRange(1))
    latency_chunks: tuple[int, ...] = opt(
        (1, 16, 64), "Chunks of the L1-miss-L2-hit latency points, comma-separated.", parse=ints
    )
    repeats: int = opt(5, "Timings per latency point (median reported).", type=click.IntRange(1))
    l1_size_gb: float = opt(1.0, "Pool of each of the two servers.", type=click.FloatRange(min=0.1))
    redis_url: str = opt(
        "",
        "An existing Redis/Valkey to use [default: start a redis-server on a free loopback port].",
    )
    l2_connections: int = opt(
        Config.l2_connections,
        "The servers' --l2-connections [default: the server's own].",
        type=click.IntRange(1, 16),
    )
    redis_io_threads: int = opt(
        1,
        "Start the redis-server with this many I/O threads (--io-threads N "
        "--io-threads-do-reads yes); not with --redis-url.",
        type=click.IntRange(1, 64),
    )
    #: The redis-server (or valkey-server) binary to start; "" = redis-server on PATH.
    redis_server: str = opt(
        "",
        "The server binary to start: redis-server or valkey-server, a name on PATH "
        "or a path [default: redis-server]; not with --redis-url.",
    )
    #: Start a Redis Cluster of this many primaries on loopback instead of one store
    #: (the servers use ``--l2 redis+cluster://...``); 0: one store.
    cluster_nodes: int = opt(
        0,
        "Start a Redis Cluster of this many primaries on loopback (each with "
        "--redis-io-threads, from --redis-server) and run the servers on "
        "--l2 redis+cluster://...; not with --redis-url [default: 0, one store].",
        flag="--redis-cluster-nodes",
        type=click.IntRange(0, 16),
    )
    #: Written to and flushed from a store the bench starts, before timing (see above);
    #: ``None`` (resolved at construction): :data:`WARM_STORE_GB`.
    warm_store_gb: float = opt(
        None,
        "Write this much to the store the bench starts, and flush it, before timing: "
        "a store that has served a while, not one that just started (0: the cold store) "
        "[default: 2]; not with --redis-url (never flushed).",
        type=click.FloatRange(min=0),
    )
    disk_dir: str = opt(
        "",
        "Instead: the disk tier on this directory "
        "(two servers sharing it) vs plain os.pwrite/os.preadv there, and a restart.",
    )
    restart_gb: float = opt(
        2.0,
        "--disk-dir: fill the directory to this much before the restart run.",
        type=click.FloatRange(min=0),
    )
    flood_chunks: int = opt(
        512,
        "--disk-dir: chunks stored back to back (and then paced below the disk's "
        "rate) to count what of the committed objects the write-behind writes (0: skip).",
        type=click.IntRange(0),
    )
    trace: str | None = opt(
        None,
        "Instead: replay this trace (as 'bench replay') with L1 "
        "alone and with L1 + L2; token hit ratio per tier. Uses a 2-layer geometry "
        "unless --layers is given.",
        flag="--replay",
        type=click.Path(exists=True, dir_okay=False),
    )
    #: The replay's lower tier: the disk tier (a temporary directory of ``l2_fraction``
    #: of the distinct bytes, plus the write-policy model's rows) or Redis.
    replay_tier: str = opt(
        "l2",
        "--replay: the lower tier, Redis (l2) or the disk tier on a temporary "
        "directory (disk: adds the model of the three disk write policies).",
        type=click.Choice(["l2", "disk"]),
    )
    limit: int = opt(1000, "--replay: the first N requests of the trace.", type=click.IntRange(1))
    l1_fraction: float = opt(
        0.05,
        "--replay: L1 size as a fraction of the replayed distinct chunk bytes.",
        type=click.FloatRange(min=0, min_open=True),
    )
    l2_fraction: float = opt(
        0.5,
        "--replay: L2 maxmemory as a fraction of the distinct chunk bytes.",
        type=click.FloatRange(min=0, min_open=True),
    )
    geometry: GeometryArgs = GeometryArgs()
    chunk_size: int = DEFAULT_CHUNK_SIZE
    #: The replay's servers' slab size.
    slab_size_mb: int = 4
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.warm_store_gb is None:
            object.__setattr__(self, "warm_store_gb", WARM_STORE_GB)
        if self.disk_dir:
            object.__setattr__(self, "disk_dir", os.path.abspath(self.disk_dir))
