"""The RESP reader alone, over a real socket pair: replies however the bytes are cut.

The sender writes from a thread in the pieces each test chooses (one byte at a time,
random sizes), so every boundary a network can produce falls somewhere: inside a reply
line, inside its CRLF, between a line and its payload.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from lmc_server.tiers.redis.resp import (
    MAX_LINE_BYTES,
    PIECE_BYTES,
    RespProtocolError,
    RespReader,
    RespReplyError,
)


@contextmanager
def feeding(
    data: bytes, sizes: list[int] | None = None, close: bool = True
) -> Iterator[RespReader]:
    """A reader of a socket whose peer sends ``data`` in pieces of ``sizes`` (cycled)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)

    def send() -> None:
        at, k = 0, 0
        try:
            while at < len(data):
                n = sizes[k % len(sizes)] if sizes else len(data)
                theirs.sendall(data[at : at + n])
                at, k = at + n, k + 1
        except OSError:
            pass
        if close:
            theirs.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        yield RespReader(ours)
    finally:
        ours.close()
        t.join(5)
        theirs.close()


def test_every_reply_kind_cut_at_every_byte() -> None:
    data = b"$5\r\nhello\r\n$-1\r\n:42\r\n-ERR wrong type\r\n_\r\n$0\r\n\r\n$3\r\nabc\r\n"
    with feeding(data, [1]) as r:
        n = r.bulk_length()
        assert n == 5
        buf = bytearray(5)
        r.read_into(memoryview(buf))
        r.crlf()
        assert buf == b"hello"
        assert r.bulk_length() is None
        assert r.integer() == 42
        with pytest.raises(RespReplyError, match="wrong type"):
            r.bulk_length()
        assert r.bulk_length() is None  # RESP3 null
        assert r.bulk_length() == 0
        r.read_into(memoryview(bytearray()))
        r.crlf()
        assert r.bulk_length() == 3
        r.skip(3)
        r.crlf()
        assert r.buffered == 0


def test_a_large_payload_lands_exactly_and_the_sink_sees_every_byte_in_order() -> None:
    payload = np.random.default_rng(1).integers(0, 256, 3 * PIECE_BYTES + 12345, np.uint8)
    data = b"$%d\r\n%b\r\n:7\r\n" % (payload.size, payload.tobytes())
    sizes = [int(x) for x in np.random.default_rng(2).integers(1, 200_000, 64)]
    with feeding(data, sizes) as r:
        assert r.bulk_length() == payload.size
        dst = np.zeros(payload.size, np.uint8)
        pieces: list[bytes] = []
        r.read_into(dst.data, lambda piece: pieces.append(bytes(piece)))
        r.crlf()
        assert r.integer() == 7
    assert dst.tobytes() == payload.tobytes()
    assert b"".join(pieces) == payload.tobytes()
    assert all(len(p) >= PIECE_BYTES for p in pieces[:-1])


@pytest.mark.parametrize(
    "data,call",
    [
        (b"+OK\r\n", "bulk"),  # a status where a bulk string was expected
        (b"$3\r\nabcXY", "bulk+crlf"),  # a bulk string not followed by CRLF
        (b"$x1\r\n", "bulk"),  # not a length
        (b"$-2\r\n", "bulk"),
        (b"$" + b"9" * (MAX_LINE_BYTES + 10), "bulk"),  # a line that never ends
        (b"$1\r\n:", "integer-after"),  # a bulk string where an integer was expected
    ],
)
def test_what_is_not_resp_is_a_protocol_error(data: bytes, call: str) -> None:
    with feeding(data, [7], close=False) as r, pytest.raises(RespProtocolError):
        if call == "bulk":
            r.bulk_length()
        elif call == "bulk+crlf":
            n = r.bulk_length()
            assert n == 3
            r.read_into(memoryview(bytearray(3)))
            r.crlf()
        else:
            r.integer()


def test_the_stream_ending_mid_value_is_a_connection_error() -> None:
    with feeding(b"$100\r\n" + b"x" * 60, [13]) as r:
        assert r.bulk_length() == 100
        with pytest.raises(ConnectionError):
            r.read_into(memoryview(bytearray(100)))
    with feeding(b"$10", [1]) as r, pytest.raises(ConnectionError):
        r.bulk_length()
