"""Which zmq connection each peer identity arrived on, so a closed connection can be
turned into the sessions it carried.

zmq's socket monitor reports accepted and disconnected connections by file descriptor,
never by peer identity; each message can be asked for its source descriptor (SRCFD).
Descriptor numbers are reused, so every accept bumps a per-descriptor generation and a
connection is ``(descriptor, generation)``. Invariant: a peer is attributed to the
generation current when its first message is handled, and the caller drains accept
events before attributing, so a peer is never attributed to an older connection that
happened to have the same descriptor.
"""

from __future__ import annotations

Conn = tuple[int, int]


class ConnectionTracker:
    """Descriptor generations and the peers seen on each connection."""

    def __init__(self) -> None:
        self._gen: dict[int, int] = {}
        self._peers: dict[Conn, list[bytes]] = {}

    def accepted(self, fd: int) -> None:
        self._gen[fd] = self._gen.get(fd, 0) + 1

    def attribute(self, identity: bytes, fd: int) -> Conn:
        """Record that ``identity`` talks over the current connection on ``fd``."""
        conn = (fd, self._gen.get(fd, 0))
        self._peers.setdefault(conn, []).append(identity)
        return conn

    def closed(self, fd: int) -> tuple[Conn, list[bytes]]:
        """The connection on ``fd`` closed: its key and the peers seen on it."""
        conn = (fd, self._gen.get(fd, 0))
        return conn, self._peers.pop(conn, [])
