"""asyncio client: many requests in flight on one connection, matched by ``req_id``.

A reader task owns the socket's receive side and resolves one future per request, so
callers can ``await`` stores, retrieves and lookups concurrently (the vLLM connector
and the latency benchmark do).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from lmc_server import PROTOCOL_VERSION
from lmc_server.buffers import BufferSpec
from lmc_server.cache.geometry import GroupSpec
from lmc_server.client.core import (
    BlockIds,
    ChunkResult,
    CurveKeys,
    Registration,
    RequestBuilder,
    configure_socket,
    needs_new_hello,
    stats_report,
)
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.protocol.stats import StatsReport


def _release(sock: zmq.asyncio.Socket, ctx: zmq.asyncio.Context) -> None:
    """Close the socket (no linger) and destroy the context: never blocks.

    Runs from :meth:`AsyncClient.close`, or from a ``weakref.finalize`` when a client is
    garbage-collected or still open at interpreter exit, so a forgotten ``close`` can
    never leave ``Context.term`` waiting on an open socket.
    """
    if not sock.closed:
        sock.close(linger=0)
    if not ctx.closed:
        ctx.destroy(linger=0)


class AsyncClient:
    """Create with ``await AsyncClient.connect(endpoint)``; close with ``await close()``
    or use ``async with await AsyncClient.connect(...) as c``. A client never closed is
    released when collected or at exit (without waiting), never hanging the process.

    A request answered ``handshake`` (the server forgot this connection's session, e.g.
    it restarted) is retried once after a new hello, transparently.
    """

    def __init__(self, endpoint: str, timeout_s: float = 30.0,
                 curve: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._finalizer = weakref.finalize(self, _release, self._sock, self._ctx)
        configure_socket(self._sock, curve)
        self._sock.connect(endpoint)
        self._b = RequestBuilder()
        self._client_name = ""
        self._pending: dict[int, asyncio.Future[m.Reply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.welcome: m.Welcome | None = None

    @classmethod
    async def connect(cls, endpoint: str = "tcp://127.0.0.1:5555", timeout_s: float = 30.0,
                      client_name: str = "", curve: CurveKeys | None = None) -> AsyncClient:
        self = cls(endpoint, timeout_s, curve)
        self._client_name = client_name
        self._reader = asyncio.get_running_loop().create_task(self._read())
        await self._hello()
        return self

    async def _hello(self) -> None:
        self.welcome = await self._call(m.Hello(req_id=self._b.next_id(),
                                                protocol_version=PROTOCOL_VERSION,
                                                client_name=self._client_name), m.Welcome)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
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

    async def _call(self, msg: m._Msg, expected: type[Any]) -> Any:
        reply = await self._roundtrip(msg)
        if needs_new_hello(reply, msg, self.welcome is not None):
            await self._hello()
            reply = await self._roundtrip(msg)
        return RequestBuilder.check(reply, expected)

    async def _roundtrip(self, msg: m._Msg) -> m.Reply:
        fut: asyncio.Future[m.Reply] = asyncio.get_running_loop().create_future()
        self._pending[msg.req_id] = fut
        try:
            await self._sock.send(encode(msg))
            reply = await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no reply from {self.endpoint} to "
                               f"{type(msg).__name__.lower()} within {self.timeout_s} s"
                               ) from None
        finally:
            self._pending.pop(msg.req_id, None)
        return reply

    # -- requests -----------------------------------------------------------------------

    async def ping(self) -> m.Pong:
        return await self._call(m.Ping(req_id=self._b.next_id()), m.Pong)

    async def stats(self) -> StatsReport:
        return stats_report(await self._call(m.Stats(req_id=self._b.next_id()), m.StatsResult))

    async def register(self, *, model: str, kv_dtype: str, arch: str,
                       groups: Sequence[GroupSpec], buffers: Sequence[BufferSpec] = (),
                       world_size: int = 1, rank: int = 0,
                       replicated: bool = False) -> Registration:
        msg = RequestBuilder.register_msg(self._b.next_id(), model=model, kv_dtype=kv_dtype,
                                          arch=arch, groups=groups, buffers=buffers,
                                          world_size=world_size, rank=rank,
                                          replicated=replicated)
        return RequestBuilder.registration(await self._call(msg, m.Registered), groups)

    async def unregister(self, reg: Registration) -> None:
        await self._call(m.Unregister(req_id=self._b.next_id(),
                                      registration_id=reg.registration_id), m.Unregistered)

    async def lookup(self, reg: Registration, digests: bytes, salt: bytes = b"",
                     lease: bool = True) -> m.LookupResult:
        return await self._call(
            m.Lookup(req_id=self._b.next_id(), registration_id=reg.registration_id,
                     digests=digests, salt=salt, lease=lease), m.LookupResult)

    async def release(self, lease_id: int) -> bool:
        reply = await self._call(m.Release(req_id=self._b.next_id(), lease_id=lease_id),
                                 m.Released)
        return bool(reply.released)

    async def store(self, reg: Registration, digests: bytes, block_ids: BlockIds,
                    salt: bytes = b"") -> ChunkResult:
        n = len(digests) // 32
        msg = m.Store(req_id=self._b.next_id(), registration_id=reg.registration_id,
                      digests=digests, block_ids=reg.encode_block_ids(block_ids, n),
                      salt=salt)
        reply = await self._call(msg, m.StoreResult)
        return RequestBuilder.chunk_result(reg, reply.statuses)

    async def retrieve(self, reg: Registration, digests: bytes, block_ids: BlockIds,
                       salt: bytes = b"", prefix_ends: Sequence[int] = ()) -> ChunkResult:
        """``prefix_ends``: several prefixes in one request (see ``m.Retrieve``)."""
        n = len(digests) // 32
        msg = m.Retrieve(req_id=self._b.next_id(), registration_id=reg.registration_id,
                         digests=digests, block_ids=reg.encode_block_ids(block_ids, n),
                         salt=salt, prefix_ends=np.asarray(prefix_ends, dtype="<i4").tobytes())
        reply = await self._call(msg, m.RetrieveResult)
        return RequestBuilder.chunk_result(reg, reply.statuses)
