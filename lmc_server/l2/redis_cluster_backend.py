"""The Redis / Valkey Cluster adapter: keys spread over the cluster's nodes by hash slot.

``redis+cluster://HOST:PORT[,HOST:PORT...]`` (``rediss+cluster://`` for TLS,
``valkey+cluster://`` too): the nodes named are where the client first learns the slot
map; any node of the cluster will do, and more than one lets the server start while
some are down. redis-py's synchronous :class:`redis.cluster.RedisCluster` does the
routing: it knows which node owns each of the 16,384 slots, sends each key's command
there, follows ``MOVED`` (a slot moved for good: it reloads the map) and ``ASK`` (a slot
being migrated: one command to the importing node), and reconnects. Reads are one
``MGET`` per slot (``mget_nonatomic``), writes one pipeline of ``SET`` per node
(``ClusterPipeline``); both run on the adapter's own threads (``--l2-connections`` each
for reads and for writes), never on the event loop.

What this adapter does not do that :class:`~lmc_server.l2.redis_backend.RedisBackend`
does: write values from the L1 slots and read them into the slots with our own RESP
code (that code speaks to one connection, and the cluster client owns its per-node
connections and its redirections). So each value is built in a buffer before it is
sent and copied into its slot after it is checked, as for Mooncake.

Failure: any error that is not a refusal of one command (a node unreachable, the
cluster down or not covering a slot, redirections that did not settle within
redis-py's retries) is ``unavailable``: the tier goes degraded (L1 serves, lookups that
miss L1 are misses) and reconnects, which succeeds once every primary answers
``PING``. A value is checked as any L2 value is, so a slot moved mid-read costs a miss
at most, never a wrong byte.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry

from lmc_server.l2.backend import L2Backend, L2Error, Value
from lmc_server.l2.url import redact_url

T = TypeVar("T")
#: Keys per ``MGET`` batch and ``SET`` per pipeline: bounds one round trip's memory.
BATCH_KEYS = 64
#: Times redis-py re-sends a command that met MOVED, ASK, TRYAGAIN or a node gone
#: (reloading the slot map in between) before the call fails.
REDIRECT_ATTEMPTS = 3


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` of each node a cluster URL names (ValueError if none)."""
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    nodes: list[tuple[str, int]] = []
    for part in netloc.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon or not port.isdigit() or not 0 < int(port) < 65536 or not host:
            raise ValueError(f"{part.strip()!r} is not HOST:PORT")
        nodes.append((host.strip("[]"), int(port)))
    return nodes


def _unavailable(e: BaseException) -> bool:
    if isinstance(e, ClusterError | RedisClusterException):
        return True  # cluster down, slot not covered, redirections that did not settle
    return not isinstance(e, ResponseError)  # OOM and the like: a refusal


class RedisClusterBackend(L2Backend):
    name = "redis-cluster"

    def __init__(
        self, url: str, password: str | None = None, timeout_s: float = 2.0, connections: int = 1
    ) -> None:
        try:
            self.nodes = cluster_nodes(url)
        except ValueError as e:
            raise ValueError(f"--l2 {redact_url(url)}: {e}") from None
        parts = urlsplit(url)
        self.tls = parts.scheme.lower().startswith(("rediss", "valkeys"))
        self.username = parts.username
        #: Query parameters go to every node's connections, as redis-py does for one.
        self.options: dict[str, Any] = dict(parse_qsl(parts.query))
        self.password = password
        self.timeout_s = timeout_s
        self.connections = connections
        self._client: Any = None
        self._reads = ThreadPoolExecutor(connections, thread_name_prefix="lmc-l2-cluster-r")
        self._writes = ThreadPoolExecutor(connections, thread_name_prefix="lmc-l2-cluster-w")

    def _make(self) -> RedisCluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
            username=self.username,
            password=self.password,
            ssl=self.tls,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), REDIRECT_ATTEMPTS),
            decode_responses=False,
            protocol=2,
            **self.options,
        )

    async def _call(self, pool: ThreadPoolExecutor, op: str, fn: Callable[..., T], *args: Any) -> T:
        client = self._client
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except (RedisError, RedisClusterException, OSError, TimeoutError) as e:
            unavailable = _unavailable(e) and client is self._client
            raise L2Error(
                f"redis cluster {op}: {type(e).__name__}: {e}", unavailable=unavailable
            ) from None

    def _connect(self) -> RedisCluster:
        client = self._make()  # loads the slot map from the first node that answers
        try:
            client.ping(target_nodes=RedisCluster.PRIMARIES)
        except BaseException:
            client.close()
            raise
        return client

    async def connect(self) -> None:
        await self.close()
        self._client = await self._call(self._reads, "connect", self._connect)

    def _mget(self, client: RedisCluster, keys: Sequence[bytes]) -> list[Value | None]:
        out: list[Value | None] = []
        for i in range(0, len(keys), BATCH_KEYS):
            out.extend(client.mget_nonatomic(list(keys[i : i + BATCH_KEYS])))
        return out

    def _mset(self, client: RedisCluster, items: Sequence[tuple[bytes, Value]]) -> None:
        for i in range(0, len(items), BATCH_KEYS):
            pipe = client.pipeline()
            for key, value in items[i : i + BATCH_KEYS]:
                pipe.set(key, value)
            pipe.execute()

    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        if self._client is None:
            raise L2Error("redis cluster: not connected")
        parts = await asyncio.gather(
            *(
                self._call(self._reads, "get", self._mget, self._client, part)
                for part in _split(keys, self.connections)
            )
        )
        return [v for part in parts for v in part]

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        if self._client is None:
            raise L2Error("redis cluster: not connected")
        await asyncio.gather(
            *(
                self._call(self._writes, "set", self._mset, self._client, part)
                for part in _split(items, self.connections)
            )
        )

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            fn = functools.partial(_close_quietly, client)
            await asyncio.get_running_loop().run_in_executor(self._reads, fn)

    async def shutdown(self) -> None:
        await self.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._reads.shutdown, True)
        await loop.run_in_executor(None, self._writes.shutdown, True)


def _close_quietly(client: RedisCluster) -> None:
    try:
        client.close()
    except (RedisError, RedisClusterException, OSError):
        pass


def _split(seq: Sequence[T], most: int) -> list[Sequence[T]]:
    n = len(seq)
    parts = max(1, min(most, n))
    step = -(-n // parts)
    return [seq[i : i + step] for i in range(0, n, step)] or [seq]
