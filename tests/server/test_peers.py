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
    assert t.closed(7) == (old, [b"old"])
    t.accepted(7)  # the kernel hands the same number to the next connection
    new = t.attribute(b"new", 7)
    assert old != new
    conn, peers = t.closed(7)
    assert conn == new and peers == [b"new"]


def test_connections_on_different_descriptors_are_independent() -> None:
    t = ConnectionTracker()
    t.accepted(3)
    t.accepted(4)
    assert t.attribute(b"x", 3) == (3, 1)
    assert t.attribute(b"y", 4) == (4, 1)
    assert t.closed(4) == ((4, 1), [b"y"])
    assert t.closed(3) == ((3, 1), [b"x"])
