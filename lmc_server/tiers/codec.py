"""L2 keys and values: what makes an L2 entry safe to serve, and nothing else.

Key::

    b"lmc2/" | space (16 bytes) | chunk key (32 bytes)

``space`` hashes everything that must match for the bytes to be reusable: the full
namespace string (model, KV dtype and record format, architecture, world size, rank or
"replicated"), the object group's layout fingerprint and the chunk size. ``chunk key``
is the L1 key without its server-local namespace id: the prefix-chained chunk digest,
already keyed by the request's cache salt. So nothing crosses namespaces in L2 either,
and two servers with the same model and geometry share entries.

Value::

    magic "LMC2" | version u8 | mask u8 | reserved u16 | space (16) | chunk key (32)
    | payload length u64 | checksum u64 | payload

``mask`` is the object's section mask (which sections of a window object are valid).
The checksum is XXH3-64 of the payload seeded with XXH3-64 of the header (checksum
field zero), so it covers both. A value is served only if the magic, version, space,
chunk key, length and checksum all match what the reader expects
(:func:`check_header`, :func:`check_payload`); anything else (corrupt, truncated,
written by another architecture or model, or by another format version) is a miss the
caller counts. The checksum detects accidental corruption (bit flips, truncation, a
half-written value); it is no defence against someone with write access to the store,
who is trusted.

Why XXH3 (the ``xxhash`` package): every byte written to or read from L2 is hashed,
on the tier's threads, and the hash was the largest cost of the server's L2 path over
redis-py's own. Measured on the 2-core CI VM, one thread, 2.7 MB values: zlib's crc32
2-4 GB/s, XXH3-64 40-65 GB/s (both release the GIL). Format version 1 used crc32; its
values are refused as ``version`` (a miss), never misread.
"""

from __future__ import annotations

import hashlib
import struct
from enum import Enum

import numpy as np
import xxhash

KEY_PREFIX = b"lmc2/"
SPACE_BYTES = 16
CHUNK_KEY_BYTES = 32
MAGIC = b"LMC2"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sBBH16s32sQQ")
HEADER_BYTES = _HEADER.size
_SUM_OFFSET = HEADER_BYTES - 8
#: The header's bytes before the checksum (:func:`header_prefix`).
HEADER_PREFIX_BYTES = _SUM_OFFSET
#: :func:`encode_into` copies and hashes in pieces of this size: small enough that a
#: piece just copied is still in the CPU cache when it is hashed (one read of the
#: source from memory, not two), large enough that the Python loop costs nothing.
PIECE_BYTES = 256 << 10


class Invalid(Enum):
    """Why a value read from L2 was not served (the ``reason`` label of a counter)."""

    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    VERSION = "version"
    FOREIGN = "foreign"
    LENGTH = "length"
    CHECKSUM = "checksum"


def space_of(namespace: str, layout_fingerprint: bytes, chunk_size: int) -> bytes:
    """The 16-byte id of everything that must match (see the module docstring)."""
    h = hashlib.blake2b(digest_size=SPACE_BYTES, person=b"lmc-l2-space")
    for part in (namespace.encode(), layout_fingerprint, str(chunk_size).encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def l2_key(space: bytes, chunk_key: bytes) -> bytes:
    assert len(space) == SPACE_BYTES and len(chunk_key) == CHUNK_KEY_BYTES
    return KEY_PREFIX + space + chunk_key


def header_prefix(space: bytes, chunk_key: bytes, mask: int, payload_bytes: int) -> bytes:
    """A value header's bytes before its checksum: what says which value it is (format
    version, sections, space, chunk key, length), without reading the payload."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, mask, 0, space, chunk_key, payload_bytes, 0)[
        :_SUM_OFFSET
    ]


def header(space: bytes, chunk_key: bytes, mask: int, payload: memoryview) -> bytes:
    """The value header for ``payload`` (checksum computed here, over header and payload).

    Called off the event loop: hashing a large payload releases the GIL.
    """
    head = bytearray(
        _HEADER.pack(MAGIC, FORMAT_VERSION, mask, 0, space, chunk_key, len(payload), 0)
    )
    struct.pack_into("<Q", head, _SUM_OFFSET, _checksum(head, payload))
    return bytes(head)


def _checksum(head_with_zero_sum: bytes | bytearray, payload: memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(head_with_zero_sum)))


def encode_value(space: bytes, chunk_key: bytes, mask: int, payload: memoryview) -> bytes:
    """Header and payload in one bytes object (one copy of the payload)."""
    return header(space, chunk_key, mask, payload) + payload


def encode_into(
    dst: memoryview | bytearray, space: bytes, chunk_key: bytes, mask: int, payload: memoryview
) -> int:
    """Write the value of ``payload`` (header, then payload) into ``dst``; its length.

    The same bytes as :func:`encode_value`, built in one pass: each piece of the
    payload is copied (numpy, without the GIL) and then hashed from the copy while it
    is in cache. Measured on the 2-core CI VM, 128 objects of 2.7 MB on four threads:
    53 ms against 98 ms for hashing the source and then copying it whole. ``dst``
    must hold ``HEADER_BYTES + len(payload)`` bytes. Called off the event loop.
    """
    m = len(payload)
    n = HEADER_BYTES + m
    if len(dst) < n:
        raise ValueError(f"buffer of {len(dst)} bytes cannot hold a value of {n}")
    head = bytearray(_HEADER.pack(MAGIC, FORMAT_VERSION, mask, 0, space, chunk_key, m, 0))
    digest = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(head))
    out = np.frombuffer(dst, np.uint8, m, HEADER_BYTES)
    src = np.frombuffer(payload, np.uint8)
    for lo in range(0, m, PIECE_BYTES):
        hi = min(m, lo + PIECE_BYTES)
        np.copyto(out[lo:hi], src[lo:hi])
        digest.update(out[lo:hi].data)
    struct.pack_into("<Q", head, _SUM_OFFSET, digest.intdigest())
    dst[:HEADER_BYTES] = head
    return n


def check_header(
    value: bytes | memoryview, space: bytes, chunk_key: bytes, object_bytes: int
) -> tuple[int, Invalid | None]:
    """``(mask, None)`` if the header is the one expected, else ``(0, reason)``.

    Cheap (no checksum); the payload is verified by :func:`check_payload`.
    """
    return check_head(value[:HEADER_BYTES], len(value), space, chunk_key, object_bytes)


def check_head(
    head: bytes | memoryview, value_bytes: int, space: bytes, chunk_key: bytes, object_bytes: int
) -> tuple[int, Invalid | None]:
    """:func:`check_header` of a value known by its first bytes (``head``, at most
    ``HEADER_BYTES``) and its length: what a reader that has not received the payload
    yet (the Redis slot reader) can check, with the same verdicts in the same order."""
    if len(head) < HEADER_BYTES or value_bytes < HEADER_BYTES:
        return 0, Invalid.TRUNCATED
    magic, version, mask, _, sp, ck, length, _ = _HEADER.unpack_from(head)
    if magic != MAGIC:
        return 0, Invalid.BAD_MAGIC
    if version != FORMAT_VERSION:
        return 0, Invalid.VERSION
    if sp != space or ck != chunk_key:
        return 0, Invalid.FOREIGN
    if length != object_bytes:
        return 0, Invalid.LENGTH
    if value_bytes != HEADER_BYTES + length:
        return 0, Invalid.TRUNCATED
    return mask, None


def check_payload(value: bytes | memoryview) -> bool:
    """Whether the checksum of a value whose header passed :func:`check_header` matches."""
    view = memoryview(value)
    (want,) = struct.unpack_from("<Q", value, _SUM_OFFSET)
    head = bytearray(view[:HEADER_BYTES])
    struct.pack_into("<Q", head, _SUM_OFFSET, 0)
    return _checksum(head, view[HEADER_BYTES:]) == want


class PayloadSum:
    """The checksum of a value whose payload arrives in pieces (the Redis slot reader
    receives it straight into an L1 slot): :meth:`update` with each piece in order,
    then :meth:`matches`. The same sum as :func:`check_payload`, over the same bytes."""

    __slots__ = ("_digest", "_want")

    def __init__(self, head: bytes | memoryview) -> None:
        (self._want,) = struct.unpack_from("<Q", head, _SUM_OFFSET)
        zeroed = bytearray(head[:HEADER_BYTES])
        struct.pack_into("<Q", zeroed, _SUM_OFFSET, 0)
        self._digest = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(zeroed))

    def update(self, piece: bytes | memoryview) -> None:
        self._digest.update(piece)

    def matches(self) -> bool:
        return int(self._digest.intdigest()) == self._want


def payload(value: bytes | memoryview) -> memoryview:
    return memoryview(value)[HEADER_BYTES:]
