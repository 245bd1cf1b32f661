"""asyncio transport of the client: many requests in flight on one connection, matched
by ``req_id``. What each request sends and how its reply is read is
:mod:`lmc_server.client.requests`, shared with the blocking client.

The socket is driven straight from the event loop, as the server's is
(:mod:`lmc_server.server.router`), not through ``zmq.asyncio``: a request is sent with a
non-blocking ``send`` from the caller, and one reader callback on zmq's descriptor
(``add_reader``) drains every queued reply and resolves the future of each, matched by
``req_id``, so callers can ``await`` stores, retrieves and lookups concurrently (the vLLM
connector and the latency benchmark do). A reply costs one callback and the caller's
wake-up: no reader task in between (one loop iteration less per request than a task
that reads and then wakes the caller), no future of zmq's per receive. zmq's descriptor
is edge-triggered: after each send the client looks whether replies arrived meanwhile
(the send may have taken their edge) and drains them. A send the high-water mark
refuses waits for the descriptor to say the socket is writable again.

The monitor is read the same way: when the connection to the server drops (the server
process died, or zmq's heartbeat gave up on a silent one) the client calls the
callbacks given to :meth:`AsyncClient.on_connection_lost`. Requests in flight are not
failed here: a silent server may still be running them, and only the caller knows
whether that is safe to ignore (the vLLM connector's link checks whether the server
restarted, :mod:`lmc_server.integration.link.link`).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

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
from lmc_server.protocol.errors import ProtocolError
from lmc_server.protocol.stats import StatsReport

T = TypeVar("T")

log = logging.getLogger(__name__)


#: zmq's flags as plain ints (pyzmq's are IntFlag members, whose operators run the enum
#: module's Python code: see :mod:`lmc_server.server.router`).
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)


def _release(sock: zmq.Socket[bytes], ctx: zmq.Context[Any], monitor: zmq.Socket[bytes]) -> None:
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
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._monitor: zmq.Socket[bytes] = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._finalizer = weakref.finalize(self, _release, self._sock, self._ctx, self._monitor)
        configure_socket(self._sock, curve)
        self._sock.connect(endpoint)
        self._b = RequestBuilder()
        self._client_name = client_name
        self._pending: dict[int, asyncio.Future[m.Reply]] = {}
        #: the loop whose readers drive the socket and its monitor (set by the start)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fds = (int(self._sock.getsockopt(zmq.FD)), int(self._monitor.getsockopt(zmq.FD)))
        #: sends waiting for the socket to be writable again (the high-water mark)
        self._writable: list[asyncio.Future[None]] = []
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
        """Start reading the socket and its monitor on the running loop and say hello;
        on a failure (no answer within the timeout, a refusal) the client is closed."""
        loop = self._loop = asyncio.get_running_loop()
        loop.add_reader(self._fds[0], self._drain)
        loop.add_reader(self._fds[1], self._watch)
        # read both once now: zmq signals a descriptor only for what arrives after a
        # read found its socket empty (an inproc monitor pipe never read before would
        # never signal its first event)
        self._drain()
        self._watch()
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
        if self._loop is None:
            if not self._finalizer.alive:
                raise RuntimeError("this AsyncClient is closed; make a new one")
            await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            for fd in self._fds:
                loop.remove_reader(fd)
        waiting: list[asyncio.Future[Any]] = [*self._pending.values(), *self._writable]
        for fut in waiting:
            if not fut.done():
                fut.set_exception(ConnectionError("client closed"))
        self._pending.clear()
        self._writable.clear()
        self._finalizer()

    def _drain(self) -> None:
        """Every queued reply to its request's future (the reader callback, and after a
        send: zmq's descriptor is edge-triggered); wake sends waiting for room."""
        sock, pending = self._sock, self._pending
        while not sock.closed:
            events = int(sock.getsockopt(_EVENTS))
            if self._writable and events & _POLLOUT:
                for room in self._writable:
                    if not room.done():
                        room.set_result(None)
                self._writable.clear()
            if not events & _POLLIN:
                return
            try:
                frame = sock.recv(_NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode_reply(frame)
            except ProtocolError as e:  # not a reply of this protocol: dropped
                log.warning("reply from %s dropped: %s", self.endpoint, e.message)
                continue
            fut = pending.pop(reply.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _watch(self) -> None:
        """The monitor's events: each disconnect calls every connection-lost callback."""
        monitor = self._monitor
        while not monitor.closed and int(monitor.getsockopt(_EVENTS)) & _POLLIN:
            try:
                event = recv_monitor_message(monitor, _NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == _DISCONNECTED:
                for cb in list(self._lost_callbacks):
                    cb()

    async def _send_later(self, payload: bytes) -> None:
        """A send the high-water mark refused: wait for room, send, and look for
        replies whose edge the send may have taken."""
        while True:
            if self._loop is None:
                raise ConnectionError("client closed")
            room = self._loop.create_future()
            self._writable.append(room)
            self._drain()  # writable already: no edge would come
            await room
            try:
                self._sock.send(payload, _NOBLOCK)
                break
            except zmq.Again:
                continue
        self._drain()

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
            try:
                self._sock.send(encode(msg), _NOBLOCK)
            except zmq.Again:
                await self._send_later(encode(msg))
            else:
                self._drain()  # the send may have taken the edge of a reply
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
