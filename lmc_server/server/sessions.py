"""Connections (sessions) and the registrations they own, each with its state table.

A session is one zmq peer identity. Registration ids are random 16-byte tokens bound to
the session that made them: a request naming a registration of another session is
refused exactly like an unknown id, so a client can only ever reach its own mappings.

Both keep their state as one value moved by an explicit transition table, as h11 keeps
a connection's (``h11/_state.py``): an event the table does not list for the current
state is a bug and raises :class:`StateError`, instead of a combination of flags no
code path expected.

A session (:data:`SESSION_TRANSITIONS`)::

    NEW --hello--> GREETED --hello--> GREETED      (hello again: the same session)
    NEW --silent_past_limit--> IGNORED              (no hello within PRE_HELLO_MESSAGES)

``NEW`` is answered hello and ping only, ``GREETED`` every request, ``IGNORED`` nothing
(no amplification: its messages are dropped unread). A session leaves the table when it
is dropped (:meth:`SessionTable.drop`); a peer that comes back is a new ``NEW`` one.

A registration (:data:`REGISTRATION_TRANSITIONS`)::

    OPEN --close--> CLOSING --idle--> CLOSED       (idle at once when no copy is in flight)

``OPEN`` takes new work; ``CLOSING`` refuses it while the copies in flight end (a store
whose registration closed during its copy is aborted, never committed); ``CLOSED``
has its mapping unmapped, which happens on entering it, after the last in-flight
operation (``end_op``), so no copy ever uses an unmapped buffer. Closing again is
allowed and changes nothing.

The hot path compares states by identity against the module's aliases (``OPEN``,
``GREETED``, ...): an enum member read through its class costs about 0.2 us in
CPython 3.11, a module global a few ns.
"""

from __future__ import annotations

import enum
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from lmc_server.cache.geometry import GroupSpec
from lmc_server.cache.view import CacheView
from lmc_server.errors import LmcError
from lmc_server.transfer.base import BufferMapping

log = logging.getLogger(__name__)


class StateError(LmcError, RuntimeError):
    """An event the state table does not allow in the current state (a bug)."""


class SessionState(enum.Enum):
    NEW = "new"  # no hello yet: hello and ping are answered
    GREETED = "greeted"  # said hello in our protocol version: every request is served
    IGNORED = "ignored"  # sent PRE_HELLO_MESSAGES without hello: dropped unread


class SessionEvent(enum.Enum):
    HELLO = "hello"  # a hello in our protocol version was answered
    SILENT_PAST_LIMIT = "silent_past_limit"  # one message more than PRE_HELLO_MESSAGES


NEW, GREETED, IGNORED = SessionState.NEW, SessionState.GREETED, SessionState.IGNORED

SESSION_TRANSITIONS: dict[SessionState, dict[SessionEvent, SessionState]] = {
    NEW: {SessionEvent.HELLO: GREETED, SessionEvent.SILENT_PAST_LIMIT: IGNORED},
    GREETED: {SessionEvent.HELLO: GREETED},
    IGNORED: {},
}


class RegistrationState(enum.Enum):
    OPEN = "open"  # takes new work
    CLOSING = "closing"  # refuses new work; copies still in flight
    CLOSED = "closed"  # no copy in flight; its mapping is unmapped


class RegistrationEvent(enum.Enum):
    CLOSE = "close"  # unregistered, or its session dropped
    IDLE = "idle"  # no copy in flight any more (or none was)


OPEN, CLOSING, CLOSED = (
    RegistrationState.OPEN,
    RegistrationState.CLOSING,
    RegistrationState.CLOSED,
)

REGISTRATION_TRANSITIONS: dict[RegistrationState, dict[RegistrationEvent, RegistrationState]] = {
    OPEN: {RegistrationEvent.CLOSE: CLOSING},
    CLOSING: {RegistrationEvent.CLOSE: CLOSING, RegistrationEvent.IDLE: CLOSED},
    CLOSED: {RegistrationEvent.CLOSE: CLOSED},
}


_S = TypeVar("_S")
_E = TypeVar("_E")


def _next(table: Mapping[_S, Mapping[_E, _S]], state: _S, event: _E) -> _S:
    """The state ``event`` moves ``state`` to in ``table``."""
    nxt = table[state].get(event)
    if nxt is None:
        raise StateError(f"{event} is not allowed in state {state}")
    return nxt


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
    #: Moved by :data:`REGISTRATION_TRANSITIONS` only (:meth:`close`, :meth:`end_op`).
    state: RegistrationState = OPEN
    #: what checking a block-id list reads of the registration (blocks per chunk, and
    #: block count or -1 for a scratch group, per group), so identical requests of
    #: registrations of one geometry are recognised (:mod:`lmc_server.server.validate`)
    ids_geometry: tuple[tuple[int, ...], tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        self.ids_geometry = (
            tuple(self.blocks_per_chunk),
            tuple([g.num_blocks if g.cached else -1 for g in self.groups]),
        )

    @property
    def lookup_only(self) -> bool:
        return self.mapping is None

    def begin_op(self) -> None:
        self.inflight += 1

    def end_op(self) -> None:
        self.inflight -= 1
        assert self.inflight >= 0
        if self.state is CLOSING and self.inflight == 0:
            self._move(RegistrationEvent.IDLE)

    def close(self) -> None:
        """Refuse new work; unmap now, or when the last in-flight copy ends."""
        self._move(RegistrationEvent.CLOSE)
        if self.state is CLOSING and self.inflight == 0:
            self._move(RegistrationEvent.IDLE)

    def _move(self, event: RegistrationEvent) -> None:
        before = self.state
        self.state = _next(REGISTRATION_TRANSITIONS, before, event)
        if self.state is CLOSED and before is not CLOSED:
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
    #: Moved by :data:`SESSION_TRANSITIONS` only (:meth:`move`).
    state: SessionState = NEW
    #: Messages received while ``NEW`` (past :data:`~lmc_server.server.dispatch.PRE_HELLO_MESSAGES`:
    #: ``IGNORED``).
    pre_hello: int = 0
    conn: tuple[int, int] | None = None  # (socket descriptor, accept generation)
    client_name: str = ""
    registrations: dict[bytes, RegisteredCache] = field(default_factory=dict)
    inflight: int = 0

    def move(self, event: SessionEvent) -> None:
        """Take ``event`` (:data:`SESSION_TRANSITIONS`; one the table does not allow
        here raises :class:`StateError`)."""
        self.state = _next(SESSION_TRANSITIONS, self.state, event)


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
        if reg is None or reg.session is not session or reg.state is not OPEN:
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
