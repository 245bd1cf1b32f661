"""The disk tier's two file layouts, and which one a write takes.

::

    packed:   | L2 value header (72 B) | payload (m B) |                 size 72 + m
    aligned:  | L2 value header (72 B) | zeros to 4 KiB | payload (m B) | size 4096 + m

Both hold the L2 value of :mod:`lmc_server.tiers.codec` (the same header: magic, version,
space, chunk key, length ``m``, XXH3 checksum over header and payload, never over the
zeros), so a file is checked exactly as a Redis value is.

Why two: direct I/O (``O_DIRECT``) needs the memory, the file offset and the length of
every write aligned to the device's blocks. In the packed layout the payload starts at
offset 72, so it cannot go to disk from where it lies; it is copied (with the header)
into an aligned buffer first, a copy that costs the tier a tenth to a quarter of the
plain-write figure on the H200 host (docs/benchmarks.md, "l2 --disk-dir"). In the
aligned layout the payload starts at ``ALIGN_BYTES``: a write is one ``pwritev`` of a
4 KiB header block and the payload straight from its pinned L1 slot (and, for a length
that is not a multiple of 4 KiB, the last partial block copied into a second 4 KiB
buffer), with no copy of the payload at all. L1 slots of objects of 256 KiB and more
start on 4 KiB boundaries (slabs are page-aligned, and
:func:`lmc_server.cache.slabs.slot_stride` rounds their stride up), so every DSV4.1
object qualifies.

Which: :func:`aligned_ok` (direct I/O on, the payload's address aligned, at least
``MIN_ALIGNED_PAYLOAD`` long: below that the copy is cheap and the 4 KiB of zeros are
not). Every other write, and every write of a value that is not in an L1 slot, is
packed.

A reader tells the two apart by the file's size against the header's length ``m``
(:func:`value_of_file`); a file of any other size is left as it is and fails the
header's length check, a miss and a counter like any damaged file. Files of both
layouts live in the same directory and are served alike, so directories written
before the aligned layout existed stay warm.
"""

from __future__ import annotations

import struct

import numpy as np

from lmc_server.cache.slabs import ALIGNED_SLOT_MIN_BYTES
from lmc_server.tiers import codec
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk.direct_io import ALIGN_BYTES, BufferPool

#: The payload's offset in the aligned layout.
PAYLOAD_OFFSET = ALIGN_BYTES
#: Payloads shorter than this are written packed (copied): the copy is cheap there, and
#: 4 KiB of zeros would be more than 1.5 % of the file. The same bound as L1's aligned
#: slots.
MIN_ALIGNED_PAYLOAD = ALIGNED_SLOT_MIN_BYTES
_LENGTH = struct.Struct("<Q")
_LENGTH_OFFSET = codec.HEADER_BYTES - 16


def address(view: memoryview) -> int:
    """The address of ``view``'s first byte (read-only views too)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def aligned_ok(payload: memoryview, direct: bool) -> bool:
    """Whether ``payload`` (a view of an L1 slot) is written in the aligned layout."""
    return (
        direct
        and len(payload) >= MIN_ALIGNED_PAYLOAD
        and payload.c_contiguous
        and address(payload) % ALIGN_BYTES == 0
    )


def file_bytes(payload_bytes: int, aligned: bool) -> int:
    """The size on disk of a value of ``payload_bytes`` in the given layout."""
    return (PAYLOAD_OFFSET if aligned else codec.HEADER_BYTES) + payload_bytes


def value_of_file(data: memoryview) -> memoryview:
    """The L2 value (header then payload, contiguous) held by a file's bytes ``data``.

    Packed: ``data`` itself. Aligned: the header is moved up against the payload (72
    bytes copied, in ``data``'s own buffer, which must be writable) and the view from
    there returned. Anything else: ``data`` as it is (its checks fail)."""
    n = len(data)
    if n < PAYLOAD_OFFSET or data[:4] != codec.MAGIC:
        return data
    (m,) = _LENGTH.unpack_from(data, _LENGTH_OFFSET)
    if n != PAYLOAD_OFFSET + m:
        return data
    start = PAYLOAD_OFFSET - codec.HEADER_BYTES
    data[start:PAYLOAD_OFFSET] = data[: codec.HEADER_BYTES]
    return data[start:]


def write_aligned(
    path: str,
    space: bytes,
    chunk_key: bytes,
    mask: int,
    payload: memoryview,
    buffers: BufferPool,
) -> None:
    """Write ``payload`` (an aligned L1 slot, :func:`aligned_ok`) as the file ``path`` in
    the aligned layout: the header block and the last partial block (if any) from
    ``buffers``, the payload's whole blocks from where they lie. Thread; ``OSError``
    as :func:`lmc_server.tiers.disk.direct_io.write_parts`."""
    m = len(payload)
    whole = m - m % ALIGN_BYTES
    head = buffers.take(PAYLOAD_OFFSET)
    blocks = [head]
    try:
        hv = memoryview(head)
        hv[: codec.HEADER_BYTES] = codec.header(space, chunk_key, mask, payload)
        hv[codec.HEADER_BYTES :] = bytes(len(hv) - codec.HEADER_BYTES)  # reused buffers
        parts = [hv, payload[:whole]]
        if whole < m:
            tail = buffers.take(ALIGN_BYTES)
            blocks.append(tail)
            tv = memoryview(tail)
            tv[: m - whole] = payload[whole:]
            tv[m - whole :] = bytes(len(tv) - (m - whole))
            parts.append(tv)
        direct_io.write_parts(path, parts, file_bytes(m, aligned=True))
    finally:
        for b in blocks:
            buffers.give(b)
