"""The Redis / Valkey adapter: redis-py connections, pipelined, on the adapter's own threads.

A prefetch reads into the L1 slots (``reads_into_slots``): the headers first
(:meth:`RedisBackend.heads`), then pipelined ``GET`` whose replies our own RESP reader
receives straight into the reserved slots, checked there (:mod:`lmc_server.tiers.redis.reads`);
``get_many`` (``MGET``) stays for callers that want values. Writes are one pipeline of
``SET`` per batch (no MULTI/EXEC, the writes are independent), sent straight from the L1
slots (``writes_from_slots``; see :meth:`RedisBackend._send_slots`). The calls run
on the adapter's own threads, ``connections`` (``--l2-connections``, default 1) for
reads and as many for writes (so a prefetch never queues behind a write-behind batch;
with more than one, each batch is split across them and sent over parallel
connections), with redis-py's synchronous client: measured
on the 2-core CI VM, its pipelined ``SET`` of MB-sized values is up to twice as fast as
the asyncio client on the server's loop, and socket IO releases the GIL, so the event
loop is never blocked. redis-py's own retries are off: a failed call surfaces at once as
:class:`L2Error` and the tier decides (degraded state, reconnect with backoff).
``rediss://`` (TLS) is redis-py's: certificate options go in the URL query
(``?ssl_ca_certs=/path/ca.pem``), see docs/l2.md.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from lmc_server.threadnames import name_os_thread
from lmc_server.tiers import codec, settle
from lmc_server.tiers.backend import (
    Head,
    L2Backend,
    L2Error,
    ReadResult,
    SlotObject,
    SlotRead,
    Value,
)
from lmc_server.tiers.redis import reads as redis_reads
from lmc_server.tiers.redis.resp import RespProtocolError
from lmc_server.tiers.url import redact_url

#: Keys per MGET and SETs per pipeline: bounds one round trip's memory on both ends.
GET_BATCH_KEYS = 64
PUT_BATCH_KEYS = 64
#: Threads that checksum the values of a write batch ahead of its connection's send.
HASH_THREADS = 2
#: The three kinds of thread a call runs on (:meth:`RedisBackend._on_parts`): value
#: reads into slots, writes from slots, and header reads (one thread: a small round
#: trip of the next prefetch batch while the read threads receive the current one).
READS, WRITES, HEADS = "r", "w", "q"
T = TypeVar("T")


def _error(op: str, e: BaseException) -> L2Error:
    unavailable = isinstance(e, RedisConnectionError | RedisTimeoutError | OSError | TimeoutError)
    return L2Error(f"redis {op}: {type(e).__name__}: {e}", unavailable=unavailable)


def _split(seq: Sequence[T], most: int) -> list[Sequence[T]]:
    """``seq`` in at most ``most`` contiguous parts of near-equal length (order kept:
    the parts' results concatenate back to one per item)."""
    n = len(seq)
    parts = max(1, min(most, n))
    step = -(-n // parts)
    return [seq[i : i + step] for i in range(0, n, step)] or [seq]


class RedisBackend(L2Backend):
    name = "redis"
    writes_from_slots = True
    reads_into_slots = True

    def __init__(
        self, url: str, password: str | None = None, timeout_s: float = 2.0, connections: int = 1
    ) -> None:
        scheme, rest = url.split("://", 1)
        scheme = {"valkey": "redis", "valkeys": "rediss"}.get(scheme.lower(), scheme.lower())
        self.url = f"{scheme}://{rest}"
        try:  # redis-py makes every query parameter a keyword of its connections: a
            # name it does not know fails here, at startup, not in the background task
            redis.ConnectionPool.from_url(self.url).make_connection()
        except (TypeError, ValueError) as e:
            raise ValueError(f"--l2 {redact_url(url)}: redis-py cannot use this URL: {e}") from None
        self.password = password
        self.timeout_s = timeout_s
        self.connections = connections
        self._client: Any = None
        self._reads = ThreadPoolExecutor(
            connections, thread_name_prefix="lmc-redis-r", initializer=name_os_thread
        )
        #: Header reads of the next prefetch batch, while the read threads receive the
        #: current one (one more connection).
        self._heads = ThreadPoolExecutor(
            1, thread_name_prefix="lmc-redis-q", initializer=name_os_thread
        )
        self._writes = ThreadPoolExecutor(
            connections, thread_name_prefix="lmc-redis-w", initializer=name_os_thread
        )
        self._hash = ThreadPoolExecutor(
            HASH_THREADS, thread_name_prefix="lmc-redis-h", initializer=name_os_thread
        )

    def _make(self) -> Any:
        return redis.Redis.from_url(
            self.url,
            password=self.password,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            decode_responses=False,
            protocol=2,  # what redis_reads parses (redis-py 8 would ask for RESP3)
            max_connections=2 * self.connections + 2,  # reads, writes, headers, connect
        )

    async def _call(self, pool: ThreadPoolExecutor, op: str, fn: Callable[..., T], *args: Any) -> T:
        client = self._client
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except (RedisError, OSError, TimeoutError) as e:
            raise self._failure(op, e, client) from None

    def _failure(self, op: str, e: BaseException, client: Any) -> L2Error:
        """The :class:`L2Error` of a call made on ``client`` that raised ``e``.

        A call that fails after the tier reconnected meanwhile (on a client
        :meth:`connect` has retired, or timed out on the store the tier already found
        gone) says nothing new about the store: it is a refusal
        (counted), not a second outage for the tier to report."""
        err = _error(op, e)
        if client is not None and client is not self._client and err.unavailable:
            return L2Error(f"{err} (on a connection since replaced)", unavailable=False)
        return err

    async def connect(self) -> None:
        await self._retire()
        client = self._make()
        await self._call(self._reads, "connect", client.ping)
        self._client = client

    def _mget(self, client: Any, keys: Sequence[bytes]) -> list[Value | None]:
        out: list[Value | None] = []
        for i in range(0, len(keys), GET_BATCH_KEYS):
            out.extend(client.mget(list(keys[i : i + GET_BATCH_KEYS])))
        return out

    def _mset(self, client: Any, items: Sequence[tuple[bytes, Value]]) -> None:
        for i in range(0, len(items), PUT_BATCH_KEYS):
            pipe = client.pipeline(transaction=False)
            for key, value in items[i : i + PUT_BATCH_KEYS]:
                pipe.set(key, value)
            pipe.execute()

    def _send_slots(self, client: Any, objects: Sequence[SlotObject]) -> None:
        """``SET`` every object, pipelined, its payload sent from the L1 slot itself.

        The commands are RESP written here, not by redis-py: its packer (hiredis's)
        copies every argument into one new bytes object, and building a value first
        (header + payload) is another copy; measured with py-spy on the 2-core CI VM,
        that packing took more of the write thread than the socket did. So each value
        goes out as its command prefix and header (small), then the slot's bytes, with
        the checksums computed ahead on ``HASH_THREADS`` threads while earlier objects
        are being sent. Every reply is read, so an error reply (out of memory) leaves
        the connection in step; it is raised once all were read.
        """
        heads = [
            self._hash.submit(codec.header, o.space, o.chunk_key, o.mask, o.payload)
            for o in objects
        ]
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            for i in range(0, len(objects), PUT_BATCH_KEYS):
                part = range(i, min(len(objects), i + PUT_BATCH_KEYS))
                chunks: list[bytes | memoryview] = []
                lead = b""
                for k in part:
                    o = objects[k]
                    chunks.append(
                        lead
                        + b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b"
                        % (len(o.key), o.key, o.value_bytes, heads[k].result())
                    )
                    chunks.append(o.payload.cast("B"))
                    lead = b"\r\n"
                chunks.append(lead)
                conn.send_packed_command(chunks, check_health=False)
                failed: RedisError | None = None
                for _ in part:
                    try:
                        conn.read_response()
                    except redis.exceptions.ResponseError as e:
                        failed = failed or e
                if failed is not None:
                    raise failed
        except redis.exceptions.ResponseError:
            raise  # every reply was read: the connection is in step
        except BaseException:
            conn.disconnect()  # part of a batch may be sent: never reuse this stream
            raise
        finally:
            for h in heads:
                h.cancel()
            futures.wait(heads)  # none still reads a slot once the writer unpins it
            pool.release(conn)

    async def put_slots(self, objects: Sequence[SlotObject]) -> None:
        if self._client is None:
            raise L2Error("redis: not connected")
        await self._on_parts(WRITES, "set", self._send_slots, objects)

    def _on_conn(
        self, fn: Callable[[Any, Sequence[Any]], list[T]], client: Any, part: Sequence[Any]
    ) -> list[T]:
        """``fn(connection, part)`` on one pooled connection (a read thread); a
        connection that failed mid-stream is disconnected, never reused out of step."""
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            return fn(conn, part)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    async def heads(self, keys: Sequence[bytes]) -> list[Head | None]:
        if self._client is None:
            raise L2Error("redis: not connected")
        fn = functools.partial(self._on_conn, redis_reads.read_heads)
        parts = await self._on_parts(HEADS, "head", fn, keys, parts=1)
        return [h for part in parts for h in part]

    async def get_into(self, reads: Sequence[SlotRead]) -> list[ReadResult]:
        if self._client is None:
            raise L2Error("redis: not connected")
        fn = functools.partial(self._on_conn, redis_reads.read_values)
        parts = await self._on_parts(READS, "get", fn, reads)
        return [r for part in parts for r in part]

    async def _on_parts(
        self,
        kind: str,
        op: str,
        fn: Callable[[Any, Sequence[Any]], T],
        items: Sequence[Any],
        parts: int = 0,
    ) -> list[T]:
        """``fn(client, part)`` for ``items`` split across the connections (or into
        ``parts``), in parallel on the threads of ``kind`` (``READS``, ``WRITES``,
        ``HEADS``; a cluster: those of each key's node); the first failure raised as
        :class:`L2Error`.

        Returns or raises only once every part's thread is done, also when one part
        failed early or the caller is cancelled: a thread may still be receiving into
        or sending from an L1 slot, which stays reserved or pinned until this returns."""
        loop = asyncio.get_running_loop()
        client = self._client
        plan = self._plan(items, parts or self.connections, kind)
        jobs = [
            loop.run_in_executor(pool, fn, conn, [items[i] for i in idx])
            for conn, pool, idx in plan
        ]
        errors = await settle.wait_all(jobs)  # every part's exception consumed
        if errors:
            await self._failed_parts(errors)
        for e in errors:
            if isinstance(e, RespProtocolError):
                raise L2Error(f"redis {op}: {type(e).__name__}: {e}") from None
            if isinstance(e, RedisError | OSError | TimeoutError):
                raise self._failure(op, e, client) from None
            raise e
        results = [j.result() for j in jobs]
        if len(plan) == 1 or all(r is None for r in results):
            return results
        merged: list[Any] = [None] * len(items)  # one part again, in the items' order
        for (_, _, idx), part in zip(plan, results, strict=True):
            values: Sequence[Any] = part  # type: ignore[assignment]
            for i, r in zip(idx, values, strict=True):
                merged[i] = r
        return [merged]  # type: ignore[list-item]

    def _plan(
        self, items: Sequence[Any], parts: int, kind: str
    ) -> list[tuple[Any, ThreadPoolExecutor, Sequence[int]]]:
        """Which client (its connection pool) sends which of ``items`` (positions), on
        which threads: one store, the items in ``parts`` contiguous runs on the threads
        of ``kind``. A cluster routes by slot, each node on threads of its own."""
        pool = {READS: self._reads, WRITES: self._writes, HEADS: self._heads}[kind]
        return [(self._client, pool, run) for run in _split(range(len(items)), parts)]

    async def _failed_parts(self, errors: list[BaseException]) -> None:
        """Hook: parts of a call failed with ``errors`` (the cluster reloads its slot
        map on a redirection)."""

    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        if self._client is None:
            raise L2Error("redis: not connected")
        parts = await asyncio.gather(
            *(
                self._call(self._reads, "get", self._mget, self._client, part)
                for part in _split(keys, self.connections)
            )
        )
        return [v for part in parts for v in part]

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        if self._client is None:
            raise L2Error("redis: not connected")
        await asyncio.gather(
            *(
                self._call(self._writes, "set", self._mset, self._client, part)
                for part in _split(items, self.connections)
            )
        )

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(self._reads, client.close)
            except (RedisError, OSError):
                pass

    async def _retire(self) -> None:
        """Drop the client before a reconnect, closing only the connections no thread
        is using. The tier reconnects as soon as one batch fails, while other batches
        may still be sending on their own connections: closed under their threads,
        redis-py's next send on them raised ``AttributeError`` (its socket gone), which
        reached the log as a traceback instead of one more failed call. Each connection
        in use is disconnected by its thread if its call fails (:meth:`_send_slots`,
        :meth:`_on_conn`) and otherwise closes with the retired pool it goes back to."""
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._reads, self._close_idle, client
                )
            except (RedisError, OSError):
                pass

    @staticmethod
    def _close_idle(client: Any) -> None:
        client.connection_pool.disconnect(inuse_connections=False)

    async def shutdown(self) -> None:
        """Close, then wait for the threads that touch L1 slots (reads into slots,
        writes from slots, checksums): the engine unmaps the pool after this returns,
        and a thread still receiving into or sending from a slot would touch unmapped
        memory (each blocks at most the socket timeout)."""
        await self.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._reads.shutdown, True)
        self._heads.shutdown(wait=False)  # touches no slot
        await loop.run_in_executor(None, self._writes.shutdown, True)
        await loop.run_in_executor(None, self._hash.shutdown, True)
