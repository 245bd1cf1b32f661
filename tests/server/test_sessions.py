"""The state tables of a session and of a registration (``server/sessions.py``).

A session is ``NEW`` until its hello, ``GREETED`` after, ``IGNORED`` once it talked past
the pre-hello limit; a registration is ``OPEN``, ``CLOSING`` while its copies end,
``CLOSED`` (unmapped) after. Every move goes through the table; an event the table does
not list raises ``StateError`` rather than leaving a combination of flags behind.
"""

from __future__ import annotations

import pytest
import zmq

from lmc_server import PROTOCOL_VERSION
from lmc_server.client import Client
from lmc_server.errors import LmcError
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.server.dispatch import PRE_HELLO_MESSAGES
from lmc_server.server.sessions import (
    CLOSED,
    CLOSING,
    GREETED,
    IGNORED,
    NEW,
    OPEN,
    REGISTRATION_TRANSITIONS,
    SESSION_TRANSITIONS,
    RegisteredCache,
    RegistrationState,
    Session,
    SessionEvent,
    SessionState,
    SessionTable,
    StateError,
)
from lmc_server.testing.inprocess import run_server


class _Mapping:
    """A buffer mapping that counts its closes."""

    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def _registration(session: Session, mapping: _Mapping | None) -> RegisteredCache:
    return RegisteredCache(
        SessionTable.new_registration_id(),
        session,
        "ns",
        [],
        None,  # type: ignore[arg-type]  # the view is not read here
        mapping,  # type: ignore[arg-type]
        [],
    )


def test_every_state_has_a_row() -> None:
    assert set(SESSION_TRANSITIONS) == set(SessionState)
    assert set(REGISTRATION_TRANSITIONS) == set(RegistrationState)
    for rows in (SESSION_TRANSITIONS, REGISTRATION_TRANSITIONS):
        for row in rows.values():
            assert set(row.values()) <= set(rows)


def test_a_session_is_greeted_by_hello_and_stays_greeted() -> None:
    s = Session(1, b"a", 0.0)
    assert s.state is NEW
    s.move(SessionEvent.HELLO)
    assert s.state is GREETED
    s.move(SessionEvent.HELLO)  # hello again on the same connection
    assert s.state is GREETED
    with pytest.raises(StateError):
        s.move(SessionEvent.SILENT_PAST_LIMIT)
    assert s.state is GREETED


def test_an_ignored_session_takes_no_event() -> None:
    s = Session(1, b"a", 0.0)
    s.move(SessionEvent.SILENT_PAST_LIMIT)
    assert s.state is IGNORED
    for event in SessionEvent:
        with pytest.raises(StateError, match="not allowed in state"):
            s.move(event)
    assert s.state is IGNORED
    assert issubclass(StateError, LmcError) and issubclass(StateError, RuntimeError)


def test_a_registration_closed_while_copying_unmaps_after_its_last_copy() -> None:
    mapping = _Mapping()
    reg = _registration(Session(1, b"a", 0.0), mapping)
    assert reg.state is OPEN
    reg.begin_op()
    reg.begin_op()
    reg.close()
    assert reg.state is CLOSING and mapping.closes == 0
    reg.end_op()
    assert reg.state is CLOSING and mapping.closes == 0
    reg.end_op()
    assert reg.state is CLOSED and mapping.closes == 1 and reg.mapping is None
    reg.close()  # closing again changes nothing
    assert reg.state is CLOSED and mapping.closes == 1


def test_an_idle_registration_unmaps_at_close() -> None:
    mapping = _Mapping()
    reg = _registration(Session(1, b"a", 0.0), mapping)
    reg.close()
    assert reg.state is CLOSED and mapping.closes == 1
    lookup_only = _registration(Session(2, b"b", 0.0), None)
    lookup_only.close()
    assert lookup_only.state is CLOSED


def test_a_closing_registration_is_not_found() -> None:
    table = SessionTable()
    session = table.get_or_create(b"a", 0.0)
    reg = _registration(session, _Mapping())
    table.add(reg)
    assert table.find(session, reg.registration_id) is reg
    reg.begin_op()
    table.remove(reg)
    assert reg.state is CLOSING
    assert table.find(session, reg.registration_id) is None


def test_a_peer_is_answered_until_the_pre_hello_limit_then_ignored_even_for_hello() -> None:
    """Through a server: ``NEW`` is answered (ping: pong, anything else: handshake) for
    ``PRE_HELLO_MESSAGES`` messages; then ``IGNORED``, hello included; another peer is
    served meanwhile."""
    with run_server(backend="null") as ts:
        ctx = zmq.Context()
        try:
            quiet = ctx.socket(zmq.DEALER)
            quiet.setsockopt(zmq.LINGER, 0)
            quiet.connect(ts.endpoint)
            for i in range(PRE_HELLO_MESSAGES):
                msg = m.Ping(req_id=i) if i % 2 else m.Clear(req_id=i)
                quiet.send(encode(msg))
                assert quiet.poll(5000)
                reply = decode_reply(quiet.recv())
                if i % 2:
                    assert isinstance(reply, m.Pong), reply
                else:
                    assert isinstance(reply, m.Error) and reply.code == "handshake", reply
            quiet.send(encode(m.Ping(req_id=100)))
            quiet.send(encode(m.Hello(req_id=101, protocol_version=PROTOCOL_VERSION)))
            with Client(ts.endpoint) as other:  # served; its hello is answered
                other.ping()
            assert not quiet.poll(300)
            quiet.close()
        finally:
            ctx.term()
