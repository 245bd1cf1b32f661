"""A RESP reader of our own: replies off one socket, bulk strings into caller buffers.

redis-py (with hiredis) returns every bulk-string reply as a new ``bytes`` object; an
L2 read then copies it again into its L1 slot. This reader parses the replies itself
from a small buffer of its own and receives a bulk payload with ``recv_into`` straight
into the buffer the caller names (a view of the slot), so the payload crosses memory
once, from the kernel's socket buffer to the slot.

Invariants:

- Bytes that arrived in the reader's buffer ahead of a payload (at most one
  ``BUFFER_BYTES``) are copied into the caller's buffer first, then the rest is
  received in place: the caller's buffer gets exactly the payload's bytes, in order.
- A reply line is at most ``MAX_LINE_BYTES``; a longer one, a reply of a type the
  caller did not expect, a bulk string not followed by CRLF, or the end of the stream
  mid-reply raise :class:`RespProtocolError` or ``ConnectionError``: the connection is
  then out of step and must be closed, never reused.
- An error reply (``-ERR ...``) is consumed whole and raised as :class:`RespReplyError`:
  the connection stays in step.

Sans-policy: it knows nothing of L2 values (headers and checksums are
:mod:`lmc_server.tiers.codec`'s, applied by :mod:`lmc_server.tiers.redis.reads`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from lmc_server.errors import LmcError

#: The reader's own buffer: reply lines and the bytes that arrive with them.
BUFFER_BYTES = 64 << 10
MAX_LINE_BYTES = 4 << 10
#: Bytes received between two calls of a payload's ``sink`` (the checksum): small
#: enough that a piece just received is still in the CPU cache when it is hashed.
PIECE_BYTES = 256 << 10


class RespProtocolError(LmcError):
    """The stream is not the RESP reply expected: the connection is out of step."""


class RespReplyError(LmcError):
    """The store answered a command with an error reply (consumed; still in step)."""


class RespReader:
    """Reads RESP2 replies from ``sock`` (blocking, with the socket's own timeout).

    One reader per connection and per batch of replies, used by one thread.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not consumed (0 once every reply expected was read)."""
        return self._end - self._start

    def _more(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        got = self._sock.recv_into(self._view[self._end :])
        if not got:
            raise ConnectionError("the store closed the connection mid-reply")
        self._end += got

    def line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while True:  # lines are short: searching from the start again costs nothing
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._buf[self._start : at])
                self._start = at + 2
                return out
            if self._end - self._start > MAX_LINE_BYTES:
                raise RespProtocolError(f"a reply line longer than {MAX_LINE_BYTES} bytes")
            self._more()

    def bulk_length(self) -> int | None:
        """The length of the next reply, a bulk string; None for a null reply."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            try:
                n = int(rest)
            except ValueError:
                raise RespProtocolError(f"bad bulk length {rest[:32]!r}") from None
            if n < -1:
                raise RespProtocolError(f"bad bulk length {n}")
            return None if n == -1 else n
        if kind == b"-":
            raise RespReplyError(rest.decode(errors="replace"))
        if kind == b"_":  # RESP3 null
            return None
        raise RespProtocolError(f"expected a bulk string, got {line[:32]!r}")

    def integer(self) -> int:
        line = self.line()
        if line[:1] == b":":
            try:
                return int(line[1:])
            except ValueError:
                pass
        elif line[:1] == b"-":
            raise RespReplyError(line[1:].decode(errors="replace"))
        raise RespProtocolError(f"expected an integer, got {line[:32]!r}")

    def read_into(self, dst: memoryview, sink: Callable[[memoryview], None] | None = None) -> None:
        """Exactly ``len(dst)`` bytes of a payload into ``dst``; ``sink`` (if given) is
        called with every received piece, in order, as it lands (at least
        ``PIECE_BYTES`` at a time, the last piece excepted)."""
        n = len(dst)
        pos = min(n, self._end - self._start)
        if pos:
            dst[:pos] = self._view[self._start : self._start + pos]
            self._start += pos
        fed = 0
        while pos < n:
            got = self._sock.recv_into(dst[pos:], n - pos)
            if not got:
                raise ConnectionError("the store closed the connection mid-value")
            pos += got
            if sink is not None and pos - fed >= PIECE_BYTES:
                sink(dst[fed:pos])
                fed = pos
        if sink is not None and fed < n:
            sink(dst[fed:n])

    def skip(self, n: int) -> None:
        """Consume ``n`` bytes (a payload nobody wants), through the reader's buffer."""
        while n:
            if self._start == self._end:
                self._more()
            k = min(n, self._end - self._start)
            self._start += k
            n -= k

    def crlf(self) -> None:
        """The CRLF that ends a bulk string."""
        while self._end - self._start < 2:
            self._more()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            raise RespProtocolError("a bulk string not followed by CRLF")
        self._start += 2
