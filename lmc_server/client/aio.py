"""asyncio transport of the client: many requests in flight on one connection, matched
by ``req_id``. What each request sends and how its reply is read is
:mod:`lmc_server.client.requests`, shared with the blocking client.

A reader task owns the socket's receive side and resolves one future per request, so
callers can ``await`` stores, retrieves and lookups concurrently (the vLLM connector
and the latency benchmark do).

A watcher task reads the socket's monitor: when the connection to the server drops
(the server process died, or zmq's heartbeat gave up on a silent one) it calls the
callbacks given to :meth:`AsyncClient.on_connection_lost`. Requests in flight are not
failed here: a silent server may still be running them, and only the caller knows
whether that is safe to ignore (the vLLM connector's link checks whether the server
restarted, :mod:`lmc_server.integration.link.link`).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lmc_server.buffers import BufferSpec
from lmc_server.cache.geometry import GroupSpec
from lmc_server.client import shm
from lmc_server.client.core import (
    BlockIds,
    ChunkResult,
    CurveKeys,
    Registration,
    ServerError,
    configure_socket,
)
from lmc_server.client.requests import Call, RequestBuilder
from lmc_server.errors import LmcTimeoutError
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.protocol.stats import StatsReport

T = TypeVar("T")


def _release(
    sock: zmq.asyncio.Socket, ctx: zmq.asyncio.Context, monitor: zmq.asyncio.Socket
) -> None:
    """Close the socket (no linger) and destroy the context: never blocks.

    Runs from :meth:`AsyncClient.close`, or from a ``weakref.finalize`` when a client is
    garbage-collected or still open at interpreter exit, so a forgotten ``close`` can
    never leave ``Context.term`` waiting on an open socket.
    """
    if not monitor.closed:
        monitor.close(linger=0)
    if not sock.closed:
        sock.close(linger=0)
    if not ctx.closed:
        ctx.destroy(linger=0)


class AsyncClient:
    """A connection to one server, for asyncio. Either ``async with
    AsyncClient(endpoint) as c:`` (as ``with Client(endpoint) as c:``: hello on enter,
    closed on exit) or ``c = await AsyncClient.connect(endpoint)`` and ``await
    c.close()``. A client never closed is released when collected or at exit (without
    waiting), never hanging the process.

    A request answered ``handshake`` (the server forgot this connection's session, e.g.
    it restarted) is retried once after a new hello, transparently.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5555",
        timeout_s: float = 30.0,
        curve: CurveKeys | None = None,
        client_name: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._finalizer = weakref.finalize(self, _release, self._sock, self._ctx, self._monitor)
        configure_socket(self._sock, curve)
        self._sock.connect(endpoint)
        self._b = RequestBuilder()
        self._client_name = client_name
        self._pending: dict[int, asyncio.Future[m.Reply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._lost_callbacks: list[Callable[[], None]] = []
        self.welcome: m.Welcome | None = None

    @classmethod
    async def connect(
        cls,
        endpoint: str = "tcp://127.0.0.1:5555",
        timeout_s: float = 30.0,
        client_name: str = "",
        curve: CurveKeys | None = None,
    ) -> AsyncClient:
        self = cls(endpoint, timeout_s, curve, client_name)
        await self._start()
        return self

    async def _start(self) -> None:
        """Start the reader and the watcher on the running loop and say hello; on a
        failure (no answer within the timeout, a refusal) the client is closed."""
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._watcher = loop.create_task(self._watch())
        try:
            await self._hello()
        except BaseException:
            await self.close()
            raise

    def on_connection_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) each time the connection drops."""
        self._lost_callbacks.append(callback)

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._pending)

    async def _hello(self) -> None:
        self.welcome = await self._run(self._b.hello(self._client_name))

    async def __aenter__(self) -> AsyncClient:
        """Say hello unless :meth:`connect` did already."""
        if self._reader is None:
            if not self._finalizer.alive:
                raise RuntimeError("this AsyncClient is closed; make a new one")
            await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._reader = self._watcher = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("client closed"))
        self._pending.clear()
        self._finalizer()

    async def _read(self) -> None:
        while True:
            frame = await self._sock.recv()
            reply = decode_reply(frame)
            fut = self._pending.pop(reply.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for cb in list(self._lost_callbacks):
                    cb()

    async def _run(self, call: Call[T]) -> T:
        reply = await self._roundtrip(call.msg)
        if type(reply) is m.Error and call.needs_new_hello(reply, self.welcome is not None):
            await self._hello()
            reply = await self._roundtrip(call.msg)
        return call.result(reply)

    async def _roundtrip(self, msg: m._Msg) -> m.Reply:
        """Send ``msg`` and wait for the reply with its ``req_id``, at most ``timeout_s``
        from now. The timeout is a timer that fails the reply's future, not
        ``asyncio.wait_for`` (which wraps the wait in futures and callbacks of its own:
        4-6 us more per request on the 2-core VM, every request of the connector)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[m.Reply] = loop.create_future()
        self._pending[msg.req_id] = fut
        timer = loop.call_later(self.timeout_s, _expire, fut)
        try:
            await self._sock.send(encode(msg))
            reply = await fut
        except TimeoutError:
            raise LmcTimeoutError(
                f"no reply from {self.endpoint} to "
                f"{type(msg).__name__.lower()} within {self.timeout_s} s"
            ) from None
        finally:
            timer.cancel()
            self._pending.pop(msg.req_id, None)
        return reply

    # -- requests (built and read in lmc_server.client.requests) -------------------------

    async def ping(self) -> m.Pong:
        return await self._run(self._b.ping())

    async def stats(self) -> StatsReport:
        return await self._run(self._b.stats())

    async def clear(self) -> int:
        return await self._run(self._b.clear())

    async def register(
        self,
        *,
        model: str,
        kv_dtype: str,
        arch: str,
        groups: Sequence[GroupSpec],
        buffers: Sequence[BufferSpec] = (),
        world_size: int = 1,
        rank: int = 0,
        replicated: bool = False,
    ) -> Registration:
        """Shared-memory segments of this process are handed to the server by
        descriptor first (:mod:`lmc_server.client.shm`); a ``handshake`` refusal (the
        server restarted) is answered with a new hello and a new hand-over, once."""
        for attempt in (0, 1):
            fd_socket = self.welcome.fd_socket if self.welcome is not None else ""
            passed: Sequence[BufferSpec] = buffers
            if fd_socket and shm.hands_over(buffers):  # blocks on the server: off the loop
                passed = await asyncio.to_thread(
                    shm.handed_over, buffers, fd_socket, self.timeout_s
                )
            call = self._b.register(
                model=model,
                kv_dtype=kv_dtype,
                arch=arch,
                groups=groups,
                buffers=passed,
                world_size=world_size,
                rank=rank,
                replicated=replicated,
            )
            try:
                return await self._run(call)
            except ServerError as e:
                if e.code != "handshake" or attempt or self.welcome is None:
                    raise
            await self._hello()
        raise AssertionError("unreachable")

    async def unregister(self, reg: Registration) -> None:
        await self._run(self._b.unregister(reg))

    async def lookup(
        self, reg: Registration, digests: bytes, salt: bytes = b"", lease: bool = True
    ) -> m.LookupResult:
        return await self._run(self._b.lookup(reg, digests, salt, lease))

    async def lookup_batch(
        self, reg: Registration, prefixes: Sequence[bytes], salt: bytes = b"", lease: bool = True
    ) -> list[m.LookupResult]:
        """One lookup per prefix in one request (see ``m.LookupBatch``)."""
        return await self._run(self._b.lookup_batch(reg, prefixes, salt, lease))

    async def release(self, lease_id: int) -> bool:
        return await self._run(self._b.release(lease_id))

    async def store(
        self,
        reg: Registration,
        digests: bytes,
        block_ids: BlockIds,
        salt: bytes = b"",
        events: m.StoreEvents | None = None,
    ) -> ChunkResult:
        return await self._run(self._b.store(reg, digests, block_ids, salt, events))

    async def probe(
        self, namespace: str, digests: bytes, salt: bytes = b"", prefix_ends: Sequence[int] = ()
    ) -> list[int]:
        """Hit chunks per prompt, for a router (see ``m.Probe``)."""
        return await self._run(self._b.probe(namespace, digests, salt, prefix_ends))

    async def retrieve(
        self,
        reg: Registration,
        digests: bytes,
        block_ids: BlockIds,
        salt: bytes = b"",
        prefix_ends: Sequence[int] = (),
    ) -> ChunkResult:
        """``prefix_ends``: several prefixes in one request (see ``m.Retrieve``)."""
        return await self._run(self._b.retrieve(reg, digests, block_ids, salt, prefix_ends))


def _expire(fut: asyncio.Future[m.Reply]) -> None:
    """The timer of a request whose reply did not come in time."""
    if not fut.done():
        fut.set_exception(TimeoutError())
