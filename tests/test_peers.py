"""Connection tracking: a reused descriptor never drags a new peer down with an old one."""

from __future__ import annotations

from lmc_server.server.peers import ConnectionTracker


def test_closed_connection_returns_exactly_its_peers() -> None:
    t = ConnectionTracker()
    t.accepted(7)
    a = t.attribute(b"a", 7)
    conn, peers = t.closed(7)
    assert conn == a and peers == [b"a"]
    assert t.closed(7) == (a, [])  # a second close of the same connection finds nothing


def test_reused_descriptor_is_a_new_connection() -> None:
    t = ConnectionTracker()
    t.accepted(7)
    old = t.attribute(b"old", 7)
    t.accepted(7)  # the old connection's close is reported late, after the reuse
    new = t.attribute(b"new", 7)
    assert old != new
    conn, peers = t.closed(7)
    assert conn == new and peers == [b"new"]


def test_peer_seen_before_its_accept_was_drained_keeps_the_old_generation() -> None:
    t = ConnectionTracker()
    t.accepted(3)
    c1 = t.attribute(b"x", 3)
    assert c1 == (3, 1)
    t.accepted(4)
    assert t.attribute(b"y", 4) == (4, 1)
