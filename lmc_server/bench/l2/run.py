"""``lmcache bench l2``: the L2 tier through the server vs redis-py on the same bytes.

One redis-server (started here on a free loopback port unless ``--redis-url``), two
servers with ``--l2`` pointing at it: A stores, B (empty L1) finds the objects in L2.

- write: a store of ``--chunks`` fresh chunks on A, timed until A's write-behind has
  written every object to L2 (so it includes the store's own copy into L1), against
  redis-py pipelined ``SET`` of the same values (read back from L2) under other keys;
- read: a lookup on B that misses L1, timed until a lookup reports every chunk as an L1
  hit (prefetch: one batched read, header and checksum checks, copies into L1, commit),
  against redis-py ``MGET`` of the same keys, in batches like the server's;
- latency: the same for 1, 16 and 64 chunks (B's L1 cleared before each), median of
  ``--repeats``, against the raw ``MGET`` of those objects.

A store the bench starts is warmed first (``--warm-store-gb``, default 2): that much
is written to it in values of the objects' sizes and flushed, before anything is
timed. A store process that has just started pays for every new page its allocator
maps (on the H200 host, the Redis adapter alone wrote a new Valkey 9's first GB at
1.1-3 GB/s and later rounds at 4-6; after a ``FLUSHALL``, at 7.7-8.9); one that has
been serving for a while reuses the memory it freed or evicted, which is what the
figures should describe. ``--warm-store-gb 0`` measures the
cold store. A store at ``--redis-url`` is never flushed (nor warmed).

Both sides run on this host, and the raw client is synchronous redis-py with the same
batch sizes as the server's adapter. The last read is retrieved and compared byte for
byte with what A stored. Completion is polled every millisecond
(:data:`~lmc_server.bench.l2.harness.POLL_S`), which is the resolution of the
server-side timings; the harness, two servers on one tier, is :mod:`.harness`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import msgspec
import numpy as np

from lmc_server.bench.common import Report, format_table
from lmc_server.bench.l2.config import L2Config
from lmc_server.bench.l2.harness import TwoServers
from lmc_server.testing.redis_process import RedisProcess, redis_server_path, server_version
from lmc_server.tiers import codec


@contextmanager
def _redis(url: str, io_threads: int = 1, exe: str = "", cluster_nodes: int = 0) -> Iterator[str]:
    if url:
        yield url
        return
    if cluster_nodes:
        from lmc_server.testing.redis_cluster import RedisClusterProcess

        with RedisClusterProcess(cluster_nodes, exe=exe or None, io_threads=io_threads) as c:
            yield c.url
        return
    with RedisProcess(io_threads=io_threads, exe=exe or None) as r:
        yield r.url


def raw_client(url: str, socket_timeout_s: float) -> Any:
    """redis-py's own client of the store at ``url`` (a cluster client for a cluster
    URL): the baseline the server's figures are compared with."""
    import redis

    if "+cluster://" in url:
        from redis.cluster import ClusterNode, RedisCluster

        from lmc_server.tiers.redis.cluster import cluster_nodes

        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in cluster_nodes(url)],
            socket_timeout=socket_timeout_s,
        )
    return redis.Redis.from_url(url, socket_timeout=socket_timeout_s)


def _mget(client: Any, keys: list[bytes]) -> list[Any]:
    return list(
        client.mget_nonatomic(keys) if hasattr(client, "mget_nonatomic") else client.mget(keys)
    )


def _pipeline(client: Any) -> Any:
    return (
        client.pipeline()
        if hasattr(client, "mget_nonatomic")
        else client.pipeline(transaction=False)
    )


class _Redis:
    """The redis-py side: reads and writes of the same values as the server's adapter,
    in batches of its sizes."""

    def __init__(self, s: TwoServers, url: str) -> None:
        self.s, self.client = s, raw_client(url, 30)

    def keys(self, digests: bytes) -> list[bytes]:
        return [
            codec.l2_key(space, digests[i : i + 32])
            for space in self.s.spaces()
            for i in range(0, len(digests), 32)
        ]

    def get(self, keys: list[bytes]) -> tuple[float, list[Any]]:
        from lmc_server.tiers.redis.backend import GET_BATCH_KEYS

        t0 = time.perf_counter()
        values: list[Any] = []
        for i in range(0, len(keys), GET_BATCH_KEYS):
            values += _mget(self.client, keys[i : i + GET_BATCH_KEYS])
        return time.perf_counter() - t0, values

    def write(self, keys: list[bytes], _round: int) -> tuple[float, list[bytes]]:
        """What A wrote, written again under other keys: (seconds, A's keys)."""
        from lmc_server.tiers.redis.backend import PUT_BATCH_KEYS

        _, values = self.get(keys)
        if any(v is None for v in values):
            raise RuntimeError("an object A wrote is missing from L2")
        t0 = time.perf_counter()
        for i in range(0, len(keys), PUT_BATCH_KEYS):
            pipe = _pipeline(self.client)
            for k, v in zip(
                keys[i : i + PUT_BATCH_KEYS], values[i : i + PUT_BATCH_KEYS], strict=True
            ):
                pipe.set(b"bench/" + k, v)
            pipe.execute()
        return time.perf_counter() - t0, keys

    def read(self, keys: list[bytes]) -> float:
        return self.get(keys)[0]


def warm_store(url: str, value_bytes: list[int], gb: float) -> float:
    """Write ``gb`` GB of values of the sizes in ``value_bytes`` (in turn) to the store
    at ``url``, then ``FLUSHALL SYNC`` (only ever a store this bench started); seconds."""

    from lmc_server.tiers.redis.backend import PUT_BATCH_KEYS

    t0 = time.perf_counter()
    rng = np.random.default_rng(7)
    values = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in value_bytes]
    with raw_client(url, 60) as r:
        written, i = 0, 0
        while written < gb * 1e9:
            pipe = _pipeline(r)
            for _ in range(PUT_BATCH_KEYS // 4):
                v = values[i % len(values)]
                pipe.set(b"bench-warm/%d" % i, v)
                written += len(v)
                i += 1
            pipe.execute()
        r.flushall(asynchronous=False)
    return time.perf_counter() - t0


def run(cfg: L2Config) -> Report:
    report = Report(
        "l2",
        {
            "chunks": cfg.chunks,
            "rounds": cfg.rounds,
            "latency_chunks": list(cfg.latency_chunks),
            "repeats": cfg.repeats,
            "geometry": cfg.geometry.describe(),
            "chunk_size": cfg.chunk_size,
            "l1_size_gb": cfg.l1_size_gb,
            "redis": cfg.redis_url or "redis-server started here",
            "l2_connections": cfg.l2_connections,
            "redis_io_threads": cfg.redis_io_threads,
            "redis_cluster_nodes": cfg.cluster_nodes,
            "warm_store_gb": 0.0 if cfg.redis_url else cfg.warm_store_gb,
        },
    )
    if not cfg.redis_url:
        exe = cfg.redis_server or redis_server_path() or "redis-server"
        report.config["redis_server"] = server_version(exe)
    with (
        _redis(cfg.redis_url, cfg.redis_io_threads, cfg.redis_server, cfg.cluster_nodes) as url,
        ExitStack() as stack,
    ):
        s = TwoServers(cfg, stack, "l2", ["--l2", url, "--l2-connections", str(cfg.l2_connections)])
        raw = _Redis(s, url)
        stack.callback(raw.client.close)
        report.config["chunk_bytes"] = s.obj_bytes
        if not cfg.redis_url and cfg.warm_store_gb > 0:
            sizes = [codec.HEADER_BYTES + og.object_bytes for og in s.rega.object_groups]
            report.config["warm_store_s"] = warm_store(url, sizes, cfg.warm_store_gb)
        s.measure(report, raw.keys, raw.write, raw.read, raw_kept=False)
        report.summary["l2_b"] = msgspec.to_builtins(s.stats(s.cb))
    report.notes.append(
        "ratio = raw time / server time (1.0: as fast as redis-py on the same bytes; "
        "target >= 0.8 for throughput; L2 hit latency target: server <= 2x raw, i.e. "
        "ratio >= 0.5)"
    )
    report.notes.append(
        f"one chunk = {report.config['chunk_bytes']} bytes (all its "
        f"objects); write includes the store into L1; read = lookup miss "
        f"until every chunk is an L1 hit"
    )
    return report


def table(report: Report) -> str:
    return format_table(
        report.rows,
        (
            "op|operation; server_s|server s|.4f; store_s|of which store s|.4f; "
            "raw_s|redis-py s|.4f; server_gbps|server GB/s|.2f; "
            "raw_gbps|redis-py GB/s|.2f; server_objps|server obj/s|.0f; "
            "raw_objps|redis-py obj/s|.0f; ratio|raw/server|.2f"
        ),
    )
