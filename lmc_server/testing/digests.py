"""Chunk digests for tests of the cache core, without tokens or the client.

``chained_digests(n, tag)`` is ``n`` 32-byte digests, each hashing the one before (as
real prefix digests do), so two calls with the same ``tag`` share every prefix and
different tags share none. The digests are joined once at the end: appending to a
``bytes`` copies it each time, which made 40,000 digests cost seconds.
"""

from __future__ import annotations

import hashlib


def chained_digests(n: int, tag: bytes = b"") -> bytes:
    out: list[bytes] = []
    prev = bytes(32)
    for i in range(n):
        prev = hashlib.blake2b(prev + tag + i.to_bytes(4, "little"), digest_size=32).digest()
        out.append(prev)
    return b"".join(out)
