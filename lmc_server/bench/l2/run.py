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
byte with what A stored. Completion is polled every millisecond (``POLL_S``), which
is the resolution of the server-side timings.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import click
import msgspec
import numpy as np

from lmc_server.bench.common import DEFAULT_CHUNK_SIZE, GeometryArgs, Report, format_table
from lmc_server.bench.options import ints, opt
from lmc_server.bench.servers import server_flags
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.client import Client, chunk_digests
from lmc_server.config import Config
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.poll import wait_for
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.redis_process import RedisProcess, redis_server_path, server_version
from lmc_server.tiers import codec

#: Poll interval (stats, lookups): short enough to add little to a timing, long enough
#: not to take the CPU the server and redis-server need on a small host.
POLL_S = 0.001


#: What a store the bench starts is warmed with, unless ``--warm-store-gb`` says.
WARM_STORE_GB = 2.0


@dataclass(frozen=True)
class L2Config:
    """The settings of ``lmcache bench l2``: the Redis run (here), the disk tier's
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


#: The flag that gives a server each tier, for the message when it runs without one.
TIER_FLAGS = {"l2": "--l2", "disk": "--disk-dir"}


def tier_stats(c: Client, tier: str) -> Any:
    """The ``stats`` report of the server's ``tier`` (``l2`` or ``disk``)."""
    st = getattr(c.stats(), tier)
    assert st is not None, f"the server runs without {TIER_FLAGS[tier]}"
    return st


def _digests(seed: int, n: int, chunk_size: int) -> bytes:
    """Digests of ``n`` chunks of random tokens (``chunk_size`` from the server)."""
    tokens = np.random.default_rng(seed).integers(0, 100_000, n * chunk_size)
    return chunk_digests(tokens, chunk_size)


class TwoServers:
    """Servers A and B on one tier below L1 (``tier``, given by ``args``): A stores from
    a KV of random bytes, B (an empty L1 and an empty KV) finds the objects in the tier.
    Shared by the Redis run (here) and the disk tier's (:mod:`.disk`)."""

    def __init__(self, cfg: L2Config, stack: ExitStack, tier: str, args: list[str]) -> None:
        self.cfg, self.tier = cfg, tier
        n = self.max_chunks = max(cfg.chunks, *cfg.latency_chunks)
        self.args = server_flags(
            cfg.chunk_size, True, *args, "--l2-write-queue-objects", str(8 * n)
        )
        self.a = stack.enter_context(ServerProcess(self.args, l1_size_gb=cfg.l1_size_gb))
        self.b = stack.enter_context(ServerProcess(self.args, l1_size_gb=cfg.l1_size_gb))
        probe = cfg.geometry.build(1)
        per_chunk = max(blocks_per_chunk(g, cfg.chunk_size) for g in probe.groups if g.cached)
        geometry = cfg.geometry.build(n * per_chunk)
        self.src = stack.enter_context(ShmKV(geometry))
        self.src.fill_random(1)
        self.dst = stack.enter_context(ShmKV(geometry))
        self.dst.fill(0)
        self.ca = stack.enter_context(Client(self.a.endpoint, timeout_s=60))
        self.cb = stack.enter_context(Client(self.b.endpoint, timeout_s=60))
        self.rega = self.ca.register(**self.src.register_kwargs())
        self.regb = self.cb.register(**self.dst.register_kwargs())
        for c in (self.ca, self.cb):
            self.wait(functools.partial(self.is_up, c), f"{tier} tier up", 30)
        self.fps = {p.name: bytes.fromhex(p.fingerprint) for p in self.ca.stats().partitions}
        self.obj_bytes = sum(og.object_bytes for og in self.rega.object_groups)

    def stats(self, c: Client) -> Any:
        return tier_stats(c, self.tier)

    def is_up(self, c: Client) -> bool:
        return bool(self.stats(c).state == "up")

    @staticmethod
    def wait(cond: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
        wait_for(cond, what, timeout_s, POLL_S, TimeoutError)

    def written(self, c: Client) -> int:
        """Objects the tier wrote, or -1 while a write is queued or in flight."""
        st = self.stats(c)
        return -1 if st.write_queue_objects or st.writes_in_flight else int(st.objects_written)

    def spaces(self) -> list[bytes]:
        """The tier's key space of each of A's object groups."""
        reg = self.rega
        return [
            codec.space_of(reg.namespace, self.fps[og.name], reg.chunk_size)
            for og in reg.object_groups
        ]

    def store(self, digests: bytes, seed: int) -> tuple[float, float, dict[str, np.ndarray]]:
        """(store s, store until written s, block ids) of a store on A."""
        n = len(digests) // 32
        ids = block_ids_for(self.rega, n, np.random.default_rng(seed))
        objects = n * len(self.rega.object_groups)
        before = self.written(self.ca)
        t0 = time.perf_counter()
        res = self.ca.store(self.rega, digests, ids)
        if not res.ok.all():
            raise RuntimeError(f"store failed: {res.statuses}")
        t_store = time.perf_counter() - t0
        self.wait(lambda: self.written(self.ca) >= before + objects, "write-behind")
        return t_store, time.perf_counter() - t0, ids

    def hit(self, digests: bytes, n: int) -> float:
        """Seconds from a lookup that misses B's L1 until all ``n`` chunks hit in L1."""
        self.cb.clear()
        t0 = time.perf_counter()

        def all_hit() -> bool:
            r = self.cb.lookup(self.regb, digests, lease=False)
            if r.hit_chunks < n and not r.l2_pending_chunks:
                raise RuntimeError(f"{self.tier} read stopped at {r.hit_chunks} of {n} chunks")
            return r.hit_chunks >= n

        self.wait(all_hit, f"{n} chunks read from the {self.tier} tier", 600)
        return time.perf_counter() - t0

    def measure(
        self,
        report: Report,
        locate: Callable[[bytes], Any],
        raw_write: Callable[[Any, int], tuple[float, Any]],
        raw_read: Callable[[Any], float],
        raw_kept: bool,
    ) -> tuple[bytes, list[float], list[float]]:
        """The rounds, the byte check and the latency points, as rows of ``report``:
        ``locate`` finds the tier's copies of some digests, ``raw_write`` writes them
        again beside them plainly (seconds, where to read those back), ``raw_read`` reads
        them; ``raw_kept``: rows keep every round's times. Returns the last round's
        digests, its store times and its until-written times."""
        cfg, n = self.cfg, self.cfg.chunks
        nbytes, objects = n * self.obj_bytes, n * len(self.rega.object_groups)
        w_srv, w_raw, r_srv, r_raw, w_store = [], [], [], [], []
        digests, ids = b"", dict[str, np.ndarray]()
        for rnd in range(cfg.rounds):
            digests = _digests(1000 + rnd, n, self.rega.chunk_size)
            t_store, t_all, ids = self.store(digests, rnd)
            w_store.append(t_store)
            w_srv.append(t_all)
            t_raw, written = raw_write(locate(digests), rnd)
            w_raw.append(t_raw)
            r_srv.append(self.hit(digests, n))
            r_raw.append(raw_read(written))
        dst_ids = block_ids_for(self.regb, n, np.random.default_rng(99))
        look = self.cb.lookup(self.regb, digests)
        res = self.cb.retrieve(self.regb, digests, dst_ids)
        self.cb.release(look.lease_id)
        report.summary["mismatched_groups"] = sum(  # full groups: every chunk, byte for byte
            1
            for g in self.regb.groups
            if g.cached
            and g.kind != "sliding_window"
            and self.src.pages(g.name, ids[g.name].tolist())
            != self.dst.pages(g.name, dst_ids[g.name].tolist())
        )
        report.summary["retrieved_ok"] = bool(res.ok.all())
        row = functools.partial(_row, kept=raw_kept)
        report.rows.append(row(f"write {n} chunks", w_srv, w_raw, nbytes, objects))
        report.rows[0]["store_s"] = statistics.median(w_store)
        if raw_kept:
            behind = [a - b for a, b in zip(w_srv, w_store, strict=True)]
            report.rows.append(row(f"write-behind {n} chunks", behind, w_raw, nbytes, objects))
        report.rows.append(row(f"read {n} chunks", r_srv, r_raw, nbytes, objects))
        for k in cfg.latency_chunks:
            base = _digests(5000 + k, k, self.rega.chunk_size)
            self.store(base, k)
            where = locate(base)
            srv = [self.hit(base, k) for _ in range(cfg.repeats)]
            raw = [raw_read(where) for _ in range(cfg.repeats)]
            op = f"{'L2' if self.tier == 'l2' else self.tier} hit {k} chunks"
            report.rows.append(
                row(op, srv, raw, k * self.obj_bytes, k * len(self.rega.object_groups))
            )
        return digests, w_store, w_srv


def _row(
    op: str, srv: list[float], raw: list[float], nbytes: int, objects: int, kept: bool
) -> dict[str, Any]:
    t_srv, t_raw = statistics.median(srv), statistics.median(raw)
    out = {
        "op": op,
        "server_s": t_srv,
        "raw_s": t_raw,
        "server_gbps": nbytes / t_srv / 1e9,
        "raw_gbps": nbytes / t_raw / 1e9,
        "server_objps": objects / t_srv,
        "raw_objps": objects / t_raw,
        "ratio": t_raw / t_srv,
    }
    return {**out, "server_rounds_s": srv, "raw_rounds_s": raw} if kept else out


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
