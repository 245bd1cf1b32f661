"""Blocking transport of the client over a zmq DEALER socket; one instance per thread.

What each request sends and how its reply is read is :mod:`lmc_server.client.requests`,
shared with the asyncio client; this module moves frames. Each call sends one request
and waits (up to ``timeout_s``) for the reply with the same ``req_id``; replies to
requests that timed out earlier are discarded when they arrive.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypeVar

import zmq

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
from lmc_server.client.requests import Call, RequestBuilder, raw_call
from lmc_server.errors import LmcTimeoutError
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.protocol.stats import StatsReport

T = TypeVar("T")


class Client:
    """A connection to one server. Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5555",
        timeout_s: float = 30.0,
        client_name: str = "",
        hello: bool = True,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        configure_socket(self._sock, curve)
        self._sock.connect(endpoint)
        self._b = RequestBuilder()
        self._client_name = client_name
        self.welcome: m.Welcome | None = None
        if hello:
            try:
                self._hello()
            except BaseException:  # no one to close it: the caller never gets the object
                self.close()
                raise

    def _hello(self) -> None:
        self.welcome = self._run(self._b.hello(self._client_name))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # -- transport ----------------------------------------------------------------------

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames (tests of malformed input)."""
        self._sock.send_multipart(frames)

    def recv_reply(self, timeout_s: float | None = None) -> m.Reply:
        """The next reply, whatever its ``req_id`` (tests of malformed input)."""
        t = self.timeout_s if timeout_s is None else timeout_s
        if not self._sock.poll(int(t * 1000)):
            raise LmcTimeoutError(f"no reply from {self.endpoint} within {t} s")
        return decode_reply(self._sock.recv())

    def _call(self, msg: m._Msg, expected: type[Any], timeout_s: float | None = None) -> Any:
        """Send a message built by hand, return its reply (tests of server validation)."""
        return self._run(raw_call(msg, expected), timeout_s)

    def _run(self, call: Call[T], timeout_s: float | None = None) -> T:
        """Send ``call``, wait for its reply; a ``handshake`` refusal after an earlier hello
        (the server restarted, or forgot the session) is retried once after a new hello."""
        reply = self._roundtrip(call.msg, timeout_s)
        if type(reply) is m.Error and call.needs_new_hello(reply, self.welcome is not None):
            self._hello()
            reply = self._roundtrip(call.msg, timeout_s)
        return call.result(reply)

    def _roundtrip(self, msg: m._Msg, timeout_s: float | None) -> m.Reply:
        self._sock.send(encode(msg))
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                raise LmcTimeoutError(
                    f"no reply from {self.endpoint} to "
                    f"{type(msg).__name__.lower()} within the timeout"
                )
            reply = decode_reply(self._sock.recv())
            if reply.req_id == msg.req_id or (reply.req_id == 0 and isinstance(reply, m.Error)):
                return reply

    # -- requests (built and read in lmc_server.client.requests) -------------------------

    def ping(self, timeout_s: float | None = None) -> m.Pong:
        return self._run(self._b.ping(), timeout_s)

    def stats(self) -> StatsReport:
        return self._run(self._b.stats())

    def clear(self) -> int:
        return self._run(self._b.clear())

    def register(
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
            call = self._b.register(
                model=model,
                kv_dtype=kv_dtype,
                arch=arch,
                groups=groups,
                buffers=shm.handed_over(buffers, fd_socket, self.timeout_s),
                world_size=world_size,
                rank=rank,
                replicated=replicated,
            )
            try:
                return self._run(call)
            except ServerError as e:
                if e.code != "handshake" or attempt or self.welcome is None:
                    raise
            self._hello()
        raise AssertionError("unreachable")

    def unregister(self, reg: Registration) -> None:
        self._run(self._b.unregister(reg))

    def lookup(
        self, reg: Registration, digests: bytes, salt: bytes = b"", lease: bool = True
    ) -> m.LookupResult:
        return self._run(self._b.lookup(reg, digests, salt, lease))

    def lookup_batch(
        self, reg: Registration, prefixes: Sequence[bytes], salt: bytes = b"", lease: bool = True
    ) -> list[m.LookupResult]:
        """One lookup per prefix in one request (see ``m.LookupBatch``)."""
        return self._run(self._b.lookup_batch(reg, prefixes, salt, lease))

    def release(self, lease_id: int) -> bool:
        return self._run(self._b.release(lease_id))

    def store(
        self,
        reg: Registration,
        digests: bytes,
        block_ids: BlockIds,
        salt: bytes = b"",
        events: m.StoreEvents | None = None,
    ) -> ChunkResult:
        return self._run(self._b.store(reg, digests, block_ids, salt, events))

    def probe(
        self, namespace: str, digests: bytes, salt: bytes = b"", prefix_ends: Sequence[int] = ()
    ) -> list[int]:
        """Hit chunks per prompt, for a router (see ``m.Probe``)."""
        return self._run(self._b.probe(namespace, digests, salt, prefix_ends))

    def retrieve(
        self,
        reg: Registration,
        digests: bytes,
        block_ids: BlockIds,
        salt: bytes = b"",
        prefix_ends: Sequence[int] = (),
    ) -> ChunkResult:
        """``prefix_ends``: several prefixes in one request (see ``m.Retrieve``)."""
        return self._run(self._b.retrieve(reg, digests, block_ids, salt, prefix_ends))


__all__ = ["Client", "ServerError"]
