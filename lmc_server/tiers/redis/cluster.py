"""The Redis / Valkey Cluster adapter: keys spread over the cluster's nodes by hash slot.

``redis+cluster://HOST:PORT[,HOST:PORT...]`` (``rediss+cluster://`` for TLS,
``valkey+cluster://`` too): the nodes named are where the client first learns the slot
map; any node of the cluster will do, and more than one lets the server start while
some are down. redis-py's synchronous :class:`redis.cluster.RedisCluster` keeps the
slot map (which node owns each of the 16,384 slots) and one connection pool per node.

The data path is the single-node adapter's (:class:`~lmc_server.tiers.redis.backend.
RedisBackend`), per node: a batch is split by the node that owns each key's slot
(:meth:`RedisClusterBackend._plan`), and each node's share, split again over
``--l2-connections``, is written from the L1 slots and read into them by our own RESP
code on that node's pooled connections, on threads of that node's own
(``--l2-connections`` for reads and as many for writes, per node): every node gets the
parallelism one store gets, the nodes' shares move side by side, and a node that
stalls holds only its own threads. (With the connections shared by all nodes, three
nodes had about a third of them each: under Redis 7 on the H200 host, 1.4-1.6 times
one node's throughput where three stores could give three.)

Redirections: a write that meets ``MOVED`` or ``ASK`` (a slot moved, or being migrated)
is a refusal for the objects of that share (counted, not written: a later miss) and the
slot map is reloaded; a read that meets one is a miss (the reply is an error, never a
value), and a read batch with misses reloads the map at most once a second
(``MAP_REFRESH_S``), so reads follow a moved slot within a second. A value is checked as
any L2 value is, so a slot moved mid-read costs misses, never a wrong byte.

Failure: a node unreachable, the cluster down or a slot the map does not cover is
``unavailable``: the tier goes degraded (L1 serves, lookups that miss L1 are misses)
and reconnects, which succeeds once every primary answers ``PING``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterError, RedisClusterException, RedisError
from redis.retry import Retry

from lmc_server.threadnames import name_os_thread
from lmc_server.tiers.backend import Head, L2Error, Value
from lmc_server.tiers.redis.backend import (
    GET_BATCH_KEYS,
    HASH_THREADS,
    HEADS,
    PUT_BATCH_KEYS,
    RedisBackend,
    _split,
)
from lmc_server.tiers.url import redact_url

#: A read batch with misses reloads the slot map at most this often (a miss may be a
#: ``MOVED`` reply: the slot went to another node).
MAP_REFRESH_S = 1.0
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


class RedisClusterBackend(RedisBackend):
    name = "redis-cluster"

    def __init__(  # not RedisBackend's: the URL names several nodes
        self, url: str, password: str | None = None, timeout_s: float = 2.0, connections: int = 1
    ) -> None:
        try:
            self.nodes = cluster_nodes(url)
        except ValueError as e:
            raise ValueError(f"--l2 {redact_url(url)}: {e}") from None
        parts = urlsplit(url)
        self.url = url
        self.tls = parts.scheme.lower().startswith(("rediss", "valkeys"))
        self.username = parts.username
        #: Query parameters go to every node's connections, as redis-py does for one.
        self.options: dict[str, Any] = dict(parse_qsl(parts.query))
        self.password = password
        self.timeout_s = timeout_s
        self.connections = connections
        self._client: Any = None
        self._map_loaded_s = 0.0
        self._reads = ThreadPoolExecutor(connections, thread_name_prefix="lmc-l2-cluster-r")
        self._heads = ThreadPoolExecutor(1, thread_name_prefix="lmc-l2-cluster-q")
        self._writes = ThreadPoolExecutor(connections, thread_name_prefix="lmc-l2-cluster-w")
        self._hash = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="lmc-l2-cluster-h")
        #: (node ``host:port``, kind) -> that node's threads (:meth:`_node_threads`).
        self._node_pools: dict[tuple[str, str], ThreadPoolExecutor] = {}

    @property
    def write_shards(self) -> int:
        """The primaries of the slot map (before it is loaded: the nodes the URL names)."""
        cluster = self._client
        if cluster is None:
            return len(self.nodes)
        try:
            return max(1, len(cluster.get_primaries()))
        except (RedisError, RedisClusterException):
            return len(self.nodes)

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
            protocol=2,  # what redis_reads parses
            **self.options,
        )

    def _connect(self) -> RedisCluster:
        client = self._make()  # loads the slot map from the first node that answers
        try:
            client.ping(target_nodes=RedisCluster.PRIMARIES)
        except BaseException:
            _close_quietly(client)
            raise
        return client

    async def connect(self) -> None:
        await self._retire()
        try:
            client = await asyncio.get_running_loop().run_in_executor(self._reads, self._connect)
        except (RedisError, RedisClusterException, OSError, TimeoutError) as e:
            raise L2Error(f"redis cluster connect: {type(e).__name__}: {e}") from None
        self._client = client
        self._map_loaded_s = time.monotonic()

    def _failure(self, op: str, e: BaseException, client: Any) -> L2Error:
        if isinstance(e, ClusterError | RedisClusterException):
            err = L2Error(f"redis cluster {op}: {type(e).__name__}: {e}")
            if client is not None and client is not self._client:
                return L2Error(f"{err} (on a connection since replaced)", unavailable=False)
            return err
        return super()._failure(op, e, client)

    def _plan(
        self, items: Sequence[Any], parts: int, kind: str
    ) -> list[tuple[Any, ThreadPoolExecutor, Sequence[int]]]:
        """The items by the node that owns each key's slot, each node's share split in
        ``parts`` on that node's own threads of ``kind`` (:meth:`_node_threads`): every
        node gets the parallelism one store gets, the nodes' shares move side by side,
        and a node that stalls holds only its own threads."""
        cluster = self._client
        shares: dict[str, tuple[Any, list[int]]] = {}
        try:
            for i, item in enumerate(items):
                key = item if isinstance(item, bytes) else item.key
                node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(key))
                share = shares.get(node.name)
                if share is None:
                    share = shares[node.name] = (cluster.get_redis_connection(node), [])
                share[1].append(i)
        except (RedisError, RedisClusterException) as e:  # a slot the map does not cover
            raise L2Error(f"redis cluster route: {type(e).__name__}: {e}") from None
        return [
            (conn, self._node_threads(name, kind), run)
            for name, (conn, idx) in shares.items()
            for run in _split(idx, parts)
        ]

    def _node_threads(self, node: str, kind: str) -> ThreadPoolExecutor:
        """The threads of ``kind`` of one node (``host:port``), made when the slot map
        first routes to it: ``--l2-connections`` for reads and as many for writes, one
        for header reads, as the single-node adapter has for its one store."""
        pool = self._node_pools.get((node, kind))
        if pool is None:
            n = 1 if kind == HEADS else self.connections
            pool = self._node_pools[(node, kind)] = ThreadPoolExecutor(
                n,
                thread_name_prefix=f"lmc-l2-c{len(self._node_pools)}{kind}",
                initializer=name_os_thread,
            )
        return pool

    async def _failed_parts(self, errors: list[BaseException]) -> None:
        if any(isinstance(e, AskError) for e in errors):  # MovedError is one too
            await self._reload_map()

    async def _reload_map(self) -> None:
        """Reload the slot map (a CLUSTER SLOTS round trip) on a thread of its own,
        leaving every node's pool as it is (batches may be using them)."""
        cluster = self._client
        if cluster is None:
            return
        self._map_loaded_s = time.monotonic()
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._heads,
                functools.partial(
                    cluster.nodes_manager.initialize, disconnect_startup_nodes_pools=False
                ),
            )
        except (RedisError, RedisClusterException, OSError):
            pass  # the next call finds out what is wrong

    async def heads(self, keys: Sequence[bytes]) -> list[Head | None]:
        out = await super().heads(keys)
        if None in out and time.monotonic() - self._map_loaded_s >= MAP_REFRESH_S:
            await self._reload_map()  # a miss may be a slot that moved
        return out

    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        if self._client is None:
            raise L2Error("redis cluster: not connected")
        return await self._call(self._reads, "get", self._mget, self._client, keys)

    def _mget(self, client: Any, keys: Sequence[bytes]) -> list[Value | None]:
        out: list[Value | None] = []
        for i in range(0, len(keys), GET_BATCH_KEYS):
            out.extend(client.mget_nonatomic(list(keys[i : i + GET_BATCH_KEYS])))
        return out

    def _mset(self, client: Any, items: Sequence[tuple[bytes, Value]]) -> None:
        for i in range(0, len(items), PUT_BATCH_KEYS):
            pipe = client.pipeline()
            for key, value in items[i : i + PUT_BATCH_KEYS]:
                pipe.set(key, value)
            pipe.execute()

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            fn = functools.partial(_close_quietly, client)
            await asyncio.get_running_loop().run_in_executor(self._reads, fn)

    @staticmethod
    def _close_idle(client: Any) -> None:
        """Every node's idle connections (see :meth:`RedisBackend._retire`)."""
        for node in client.get_nodes():
            conn = node.redis_connection
            if conn is not None:
                conn.connection_pool.disconnect(inuse_connections=False)

    async def shutdown(self) -> None:
        """As one store's, and every node's threads too (those of reads and writes
        touch L1 slots: waited for)."""
        await super().shutdown()
        loop = asyncio.get_running_loop()
        for (_, kind), pool in list(self._node_pools.items()):
            if kind == HEADS:
                pool.shutdown(wait=False)  # touches no slot
            else:
                await loop.run_in_executor(None, pool.shutdown, True)


def _close_quietly(client: RedisCluster) -> None:
    try:
        client.close()
    except (RedisError, RedisClusterException, OSError):
        pass
