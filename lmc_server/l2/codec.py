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
    | payload length u64 | crc32 u32 | payload

``mask`` is the object's section mask (which sections of a window object are valid).
The crc32 covers the header (with the crc field zero) and the payload. A value is
served only if the magic, version, space, chunk key, length and crc32 all match what
the reader expects (:func:`check_value`); anything else (corrupt, truncated, written by
another architecture or model, or by a future format) is a miss the caller counts.
crc32 detects accidental corruption (bit flips, truncation, a half-written value); it
is no defence against someone with write access to the store, who is trusted.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from enum import Enum

KEY_PREFIX = b"lmc2/"
SPACE_BYTES = 16
CHUNK_KEY_BYTES = 32
MAGIC = b"LMC2"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBH16s32sQI")
HEADER_BYTES = _HEADER.size
_CRC_OFFSET = HEADER_BYTES - 4


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


def header(space: bytes, chunk_key: bytes, mask: int, payload: memoryview) -> bytes:
    """The value header for ``payload`` (crc32 computed here, over header and payload).

    Called off the event loop: crc32 over a large payload releases the GIL.
    """
    head = bytearray(_HEADER.pack(MAGIC, FORMAT_VERSION, mask, 0, space, chunk_key,
                                  len(payload), 0))
    crc = zlib.crc32(payload, zlib.crc32(head))
    struct.pack_into("<I", head, _CRC_OFFSET, crc)
    return bytes(head)


def encode_value(space: bytes, chunk_key: bytes, mask: int, payload: memoryview) -> bytes:
    """Header and payload in one bytes object (one copy of the payload)."""
    return header(space, chunk_key, mask, payload) + payload


def check_header(value: bytes, space: bytes, chunk_key: bytes,
                 object_bytes: int) -> tuple[int, Invalid | None]:
    """``(mask, None)`` if the header is the one expected, else ``(0, reason)``.

    Cheap (no checksum); the payload is verified by :func:`check_payload`.
    """
    if len(value) < HEADER_BYTES:
        return 0, Invalid.TRUNCATED
    magic, version, mask, _, sp, ck, length, _ = _HEADER.unpack_from(value)
    if magic != MAGIC:
        return 0, Invalid.BAD_MAGIC
    if version != FORMAT_VERSION:
        return 0, Invalid.VERSION
    if sp != space or ck != chunk_key:
        return 0, Invalid.FOREIGN
    if length != object_bytes:
        return 0, Invalid.LENGTH
    if len(value) != HEADER_BYTES + length:
        return 0, Invalid.TRUNCATED
    return mask, None


def check_payload(value: bytes) -> bool:
    """Whether the crc32 of a value whose header passed :func:`check_header` matches."""
    view = memoryview(value)
    (crc,) = struct.unpack_from("<I", value, _CRC_OFFSET)
    head = bytearray(view[:HEADER_BYTES])
    struct.pack_into("<I", head, _CRC_OFFSET, 0)
    return zlib.crc32(view[HEADER_BYTES:], zlib.crc32(head)) == crc


def payload(value: bytes) -> memoryview:
    return memoryview(value)[HEADER_BYTES:]
