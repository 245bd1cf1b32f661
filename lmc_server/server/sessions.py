"""Connections (sessions) and the registrations they own.

A session is one zmq peer identity. Registration ids are random 16-byte tokens bound to
the session that made them: a request naming a registration of another session is
refused exactly like an unknown id, so a client can only ever reach its own mappings.

A registration's mapping is closed only when no copy uses it: ``close`` marks it
closing, and the last in-flight operation (``end_op``) closes it.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from lmc_server.cache.geometry import GroupSpec
from lmc_server.cache.view import CacheView
from lmc_server.transfer.base import BufferMapping

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RegisteredCache:
    """One worker's registered KV cache as the server holds it.

    Its layout (groups, view), the mapping of the worker's memory and the count of copies
    in flight. The client's handle on the same registration is
    ``lmc_server.client.Registration``.
    """

    registration_id: bytes
    session: Session
    namespace: str
    groups: list[GroupSpec]
    view: CacheView
    mapping: BufferMapping | None
    blocks_per_chunk: list[int]
    inflight: int = 0
    closing: bool = False

    @property
    def lookup_only(self) -> bool:
        return self.mapping is None

    def begin_op(self) -> None:
        self.inflight += 1

    def end_op(self) -> None:
        self.inflight -= 1
        assert self.inflight >= 0
        if self.closing and self.inflight == 0:
            self._unmap()

    def close(self) -> None:
        """Refuse new work; unmap now, or when the last in-flight copy ends."""
        self.closing = True
        if self.inflight == 0:
            self._unmap()

    def _unmap(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
            log.debug("registration %s unmapped", self.registration_id.hex())


@dataclass(eq=False)
class Session:
    """One client connection, keyed by its zmq routing identity."""

    sid: int
    identity: bytes
    last_seen_s: float
    hello: bool = False
    pre_hello: int = 0
    conn: tuple[int, int] | None = None  # (socket descriptor, accept generation)
    client_name: str = ""
    registrations: dict[bytes, RegisteredCache] = field(default_factory=dict)
    inflight: int = 0


class SessionTable:
    """Sessions by identity and registrations by id; the only place that mints ids."""

    def __init__(self) -> None:
        self._by_identity: dict[bytes, Session] = {}
        self._registrations: dict[bytes, RegisteredCache] = {}
        self._next_sid = 1

    def __len__(self) -> int:
        return len(self._by_identity)

    @property
    def registrations(self) -> int:
        return len(self._registrations)

    def sessions(self) -> list[Session]:
        return list(self._by_identity.values())

    def get(self, identity: bytes) -> Session | None:
        return self._by_identity.get(identity)

    def get_or_create(self, identity: bytes, now_s: float) -> Session:
        s = self._by_identity.get(identity)
        if s is None:
            s = Session(self._next_sid, identity, now_s)
            self._next_sid += 1
            self._by_identity[identity] = s
        s.last_seen_s = now_s
        return s

    @staticmethod
    def new_registration_id() -> bytes:
        return secrets.token_bytes(16)

    def add(self, reg: RegisteredCache) -> None:
        self._registrations[reg.registration_id] = reg
        reg.session.registrations[reg.registration_id] = reg

    def find(self, session: Session, registration_id: bytes) -> RegisteredCache | None:
        """The registration if it exists, is open, and belongs to ``session``."""
        reg = self._registrations.get(registration_id)
        if reg is None or reg.session is not session or reg.closing:
            return None
        return reg

    def remove(self, reg: RegisteredCache) -> None:
        self._registrations.pop(reg.registration_id, None)
        reg.session.registrations.pop(reg.registration_id, None)
        reg.close()

    def drop(self, session: Session) -> list[RegisteredCache]:
        """Forget a session; returns its registrations (already closing)."""
        self._by_identity.pop(session.identity, None)
        regs = list(session.registrations.values())
        for reg in regs:
            self.remove(reg)
        return regs
