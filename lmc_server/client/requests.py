"""Every request of the protocol, written once: the message a call sends and how its
reply becomes the caller's value or a :class:`~lmc_server.client.core.ServerError`.

No sockets, no asyncio, no clock (sans-IO, as h11 splits HTTP from its transports):
:class:`RequestBuilder` turns a client call into a :class:`Call`, and the two transports,
:class:`~lmc_server.client.sync.Client` and :class:`~lmc_server.client.aio.AsyncClient`,
only send ``call.msg``, wait for the reply with its ``req_id`` and hand it to
:meth:`Call.result`. A request added here (and a one-line method on each transport) behaves
the same on both clients, byte for byte: tests/client/test_client.py holds them to that.

Invariants: request ids start at 1 and grow by one per :class:`Call` built (a retry after
a new hello resends the same message, id included); a reply is accepted only if it is
the expected type (an ``error`` raises its code, any other type raises ``bad_request``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from lmc_server import PROTOCOL_VERSION
from lmc_server.buffers import BufferSpec, ShmFdBuffer
from lmc_server.cache.geometry import GroupSpec
from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.client.core import (
    BlockIds,
    ChunkResult,
    Registration,
    ServerError,
)
from lmc_server.protocol import messages as m
from lmc_server.protocol.stats import StatsReport

T = TypeVar("T")
R = TypeVar("R", bound=m._Msg)


def _same(reply: R) -> R:
    return reply


class Call(Generic[T]):
    """One request as data: ``msg`` to send, and :meth:`result` for its reply.

    A plain slotted class, not a dataclass: one is built per request on the connector's
    per-step path, so construction stays a few attribute stores.
    """

    __slots__ = ("expected", "msg", "parse")

    def __init__(self, msg: m._Msg, expected: type[R], parse: Callable[[R], T]) -> None:
        self.msg = msg
        self.expected: type[m._Msg] = expected
        self.parse: Callable[[Any], T] = parse

    def result(self, reply: m.Reply) -> T:
        """The caller's value from ``reply``; :class:`ServerError` for a refusal, or for a
        reply of another type than the request's (``bad_request``)."""
        if isinstance(reply, self.expected):
            return self.parse(reply)
        if isinstance(reply, m.Error):
            raise ServerError(reply.code, reply.message)
        raise ServerError("bad_request", f"unexpected reply {type(reply).__name__}")

    def needs_new_hello(self, reply: m.Reply, said_hello: bool) -> bool:
        """The server no longer knows this connection's session (it restarted, or dropped
        the session): a client that had said hello says it again and resends once.
        Transports ask only after a cheap check that the reply is an ``error``."""
        return (
            said_hello
            and isinstance(reply, m.Error)
            and reply.code == "handshake"
            and not isinstance(self.msg, m.Hello)
            and not _hands_over(self.msg)
        )


def _hands_over(msg: m._Msg) -> bool:
    """A registration naming descriptors handed to one server process: a restarted
    server never got them, so the transport hands them over again and builds a new
    message (``register`` on either client) instead of resending this one."""
    return isinstance(msg, m.Register) and any(isinstance(b, ShmFdBuffer) for b in msg.buffers)


def raw_call(msg: m._Msg, expected: type[R]) -> Call[R]:
    """A call of a message built by hand (tests of the server's own validation); its
    result is the reply itself."""
    return Call(msg, expected, _same)


class RequestBuilder:
    """Builds one :class:`Call` per client request and numbers them (one per client)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    # -- session ------------------------------------------------------------------------

    def hello(self, client_name: str = "") -> Call[m.Welcome]:
        return Call(
            m.Hello(
                req_id=next(self._ids), protocol_version=PROTOCOL_VERSION, client_name=client_name
            ),
            m.Welcome,
            _same,
        )

    def ping(self) -> Call[m.Pong]:
        return Call(m.Ping(req_id=next(self._ids)), m.Pong, _same)

    def stats(self) -> Call[StatsReport]:
        return Call(m.Stats(req_id=next(self._ids)), m.StatsResult, _stats_report)

    def clear(self) -> Call[int]:
        return Call(m.Clear(req_id=next(self._ids)), m.Cleared, _evicted)

    # -- registrations ------------------------------------------------------------------

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
    ) -> Call[Registration]:
        msg = m.Register(
            req_id=next(self._ids),
            model=model,
            kv_dtype=kv_dtype,
            arch=arch,
            world_size=world_size,
            rank=rank,
            replicated=replicated,
            buffers=list(buffers),
            groups=list(groups),
        )

        def registration(reply: m.Registered) -> Registration:
            return Registration(
                reply.registration_id,
                reply.namespace,
                reply.chunk_size,
                reply.lookup_only,
                list(reply.object_groups),
                list(groups),
            )

        return Call(msg, m.Registered, registration)

    def unregister(self, reg: Registration) -> Call[None]:
        return Call(
            m.Unregister(req_id=next(self._ids), registration_id=reg.registration_id),
            m.Unregistered,
            _nothing,
        )

    # -- chunks -------------------------------------------------------------------------

    def lookup(
        self, reg: Registration, digests: bytes, salt: bytes = b"", lease: bool = True
    ) -> Call[m.LookupResult]:
        return Call(
            m.Lookup(
                req_id=next(self._ids),
                registration_id=reg.registration_id,
                digests=digests,
                salt=salt,
                lease=lease,
            ),
            m.LookupResult,
            _same,
        )

    def lookup_batch(
        self, reg: Registration, prefixes: Sequence[bytes], salt: bytes = b"", lease: bool = True
    ) -> Call[list[m.LookupResult]]:
        """One lookup per prefix (each its own chunks' digests) in one request
        (``m.LookupBatch``); the answers in order, each as :meth:`lookup` gives it."""
        ends = np.cumsum([len(p) // DIGEST_BYTES for p in prefixes], dtype=np.int64)
        msg = m.LookupBatch(
            req_id=next(self._ids),
            registration_id=reg.registration_id,
            digests=b"".join(prefixes),
            salt=salt,
            lease=lease,
            prefix_ends=ends.astype("<i4").tobytes(),
        )
        return Call(msg, m.LookupBatchResult, _lookup_results)

    def release(self, lease_id: int) -> Call[bool]:
        return Call(m.Release(req_id=next(self._ids), lease_id=lease_id), m.Released, _released)

    def store(
        self,
        reg: Registration,
        digests: bytes,
        block_ids: BlockIds,
        salt: bytes = b"",
        events: m.StoreEvents | None = None,
    ) -> Call[ChunkResult]:
        """Block ids are checked against the registration here, before anything is sent
        (``KeyError``/``ValueError``, see :meth:`Registration.encode_block_ids`).
        ``events``: what KV-event subscribers see of these chunks (``m.StoreEvents``)."""
        msg = m.Store(
            req_id=next(self._ids),
            registration_id=reg.registration_id,
            digests=digests,
            block_ids=reg.encode_block_ids(block_ids, len(digests) // DIGEST_BYTES),
            salt=salt,
            events=events,
        )

        def statuses(reply: m.StoreResult) -> ChunkResult:
            return chunk_result(reg, reply.statuses)

        return Call(msg, m.StoreResult, statuses)

    def retrieve(
        self,
        reg: Registration,
        digests: bytes,
        block_ids: BlockIds,
        salt: bytes = b"",
        prefix_ends: Sequence[int] = (),
    ) -> Call[ChunkResult]:
        """``prefix_ends``: several prefixes in one request (see ``m.Retrieve``)."""
        msg = m.Retrieve(
            req_id=next(self._ids),
            registration_id=reg.registration_id,
            digests=digests,
            block_ids=reg.encode_block_ids(block_ids, len(digests) // DIGEST_BYTES),
            salt=salt,
            prefix_ends=(
                np.asarray(prefix_ends, dtype="<i4").tobytes() if len(prefix_ends) else b""
            ),
        )

        def statuses(reply: m.RetrieveResult) -> ChunkResult:
            return chunk_result(reg, reply.statuses)

        return Call(msg, m.RetrieveResult, statuses)

    def probe(
        self, namespace: str, digests: bytes, salt: bytes = b"", prefix_ends: Sequence[int] = ()
    ) -> Call[list[int]]:
        """Hit chunks per prompt (see ``m.Probe``), without a registration or a lease."""
        msg = m.Probe(
            req_id=next(self._ids),
            namespace=namespace,
            digests=digests,
            salt=salt,
            prefix_ends=(
                np.asarray(prefix_ends, dtype="<i4").tobytes() if len(prefix_ends) else b""
            ),
        )
        return Call(msg, m.ProbeResult, _hit_chunks)


def _hit_chunks(reply: m.ProbeResult) -> list[int]:
    return np.frombuffer(reply.hit_chunks, dtype="<i4").tolist()


def _lookup_results(reply: m.LookupBatchResult) -> list[m.LookupResult]:
    """One :class:`m.LookupResult` per lookup of the batch; a reply whose arrays
    disagree in length raises ``ValueError``."""
    hits = np.frombuffer(reply.hit_chunks, dtype="<i4").tolist()
    leases = np.frombuffer(reply.lease_ids, dtype="<u8").tolist()
    pending = (
        np.frombuffer(reply.l2_pending_chunks, dtype="<i4").tolist()
        if reply.l2_pending_chunks
        else [0] * len(hits)
    )
    if not len(hits) == len(leases) == len(pending):
        raise ValueError(
            f"lookup_batch_result of {len(hits)} hits, {len(leases)} leases "
            f"and {len(pending)} pending counts"
        )
    return [
        m.LookupResult(
            req_id=reply.req_id,
            hit_chunks=h,
            lease_id=lid,
            lease_ttl_s=reply.lease_ttl_s if lid else 0.0,
            l2_pending_chunks=p,
        )
        for h, lid, p in zip(hits, leases, pending, strict=True)
    ]


def _nothing(reply: m._Msg) -> None:
    return None


def _stats_report(reply: m.StatsResult) -> StatsReport:
    return reply.stats


def _evicted(reply: m.Cleared) -> int:
    return int(reply.evicted)


def _released(reply: m.Released) -> bool:
    return bool(reply.released)


def chunk_result(reg: Registration, statuses: list[bytes]) -> ChunkResult:
    """Per object group of ``reg``, one status byte per chunk; a reply whose count of
    groups does not match the registration raises ``ValueError``."""
    return ChunkResult(
        {
            og.name: np.frombuffer(s, dtype=np.uint8)
            for og, s in zip(reg.object_groups, statuses, strict=True)
        }
    )
