"""Redis reads into L1 slots: one connection's share of a prefetch batch (I/O thread).

Two pipelined round trips per share, both parsed by
:class:`~lmc_server.tiers.redis.resp.RespReader`:

1. :func:`read_heads`: ``STRLEN`` and ``GETRANGE key 0 71`` of every key. The
   prefetch checks each header (:func:`lmc_server.tiers.codec.check_head`: magic,
   version, namespace, chunk key, length) before it reserves a slot, so a missing,
   damaged or foreign value costs L1 nothing (no slot, no eviction).
2. :func:`read_values`: ``GET`` of every key whose slot was reserved. Each reply's
   first 72 bytes (the header) land in a small buffer and are checked again (the
   value may have changed since step 1); the payload is received straight into the
   slot, its checksum (:class:`lmc_server.tiers.codec.PayloadSum`) computed piece by piece
   as it lands. A value whose length, header, mask or checksum is not the one
   expected is drained and reported (never ``True``): the prefetch aborts its slot.

The connection is redis-py's (it did the connect, AUTH, SELECT and TLS); this module
writes the commands with its ``send_packed_command`` and reads the replies from its
socket. Every reply sent for is read before the connection goes back to the pool; if
anything fails mid-stream, the caller disconnects it (never reused out of step).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from lmc_server.tiers import codec
from lmc_server.tiers.backend import Head, ReadResult, SlotRead
from lmc_server.tiers.redis.resp import RespProtocolError, RespReader, RespReplyError

_HEAD_END = b"%d" % (codec.HEADER_BYTES - 1)


def _sock(conn: Any) -> socket.socket:
    """The connected socket of a redis-py connection (SSL-wrapped for ``rediss://``)."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        raise ConnectionError("the redis connection has no socket")
    return sock


def _cmd(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


def read_heads(conn: Any, keys: Sequence[bytes]) -> list[Head | None]:
    """The length and first ``HEADER_BYTES`` of each key's value (None: absent, empty,
    or not a string)."""
    conn.send_packed_command(
        [_cmd(b"STRLEN", k) + _cmd(b"GETRANGE", k, b"0", _HEAD_END) for k in keys],
        check_health=False,
    )
    reader = RespReader(_sock(conn))
    out: list[Head | None] = []
    for _ in keys:
        try:
            total: int | None = reader.integer()
        except RespReplyError:  # WRONGTYPE: a key of ours holding no string
            total = None
        try:
            n = reader.bulk_length()
        except RespReplyError:
            n = None
        head = b""
        if n is not None:
            if n > codec.HEADER_BYTES:
                raise RespProtocolError(f"GETRANGE returned {n} bytes")
            buf = bytearray(n)
            reader.read_into(memoryview(buf))
            reader.crlf()
            head = bytes(buf)
        out.append(None if not total or not head else (head, total))
    if reader.buffered:
        raise RespProtocolError("bytes after the last reply")
    return out


def read_values(conn: Any, reads: Sequence[SlotRead]) -> list[ReadResult]:
    """``GET`` every value into its slot, verified (see the module docstring)."""
    conn.send_packed_command([_cmd(b"GET", r.key) for r in reads], check_health=False)
    reader = RespReader(_sock(conn))
    head = bytearray(codec.HEADER_BYTES)
    head_view = memoryview(head)
    out: list[ReadResult] = []
    for r in reads:
        try:
            n = reader.bulk_length()
        except RespReplyError:
            n = None
        if n is None:
            out.append(None)
            continue
        got = min(n, codec.HEADER_BYTES)
        reader.read_into(head_view[:got])
        mask, bad = codec.check_head(head_view[:got], n, r.space, r.chunk_key, len(r.dest))
        if bad is not None or mask != r.mask:
            reader.skip(n - got)
            reader.crlf()
            out.append(bad)
            continue
        check = codec.PayloadSum(head_view)
        reader.read_into(r.dest, check.update)
        reader.crlf()
        out.append(True if check.matches() else codec.Invalid.CHECKSUM)
    if reader.buffered:
        raise RespProtocolError("bytes after the last reply")
    return out
