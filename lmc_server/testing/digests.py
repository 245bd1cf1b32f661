"""Chunk digests for tests of the cache core, without tokens or the client.

``chained_digests(n, tag)`` is ``n`` 32-byte digests, each hashing the one before (as
real prefix digests do), so two calls with the same ``tag`` share every prefix and
different tags share none.
"""

from __future__ import annotations

import hashlib


def chained_digests(n: int, tag: bytes = b"") -> bytes:
    out, prev = b"", bytes(32)
    for i in range(n):
        prev = hashlib.blake2b(prev + tag + i.to_bytes(4, "little"), digest_size=32).digest()
        out += prev
    return out
