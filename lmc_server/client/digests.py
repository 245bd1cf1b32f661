"""Prefix-chained chunk digests, computed by clients (the server never sees tokens).

``digest[k] = blake2b(digest[k-1] || payload[k])`` with a 32-byte zero seed, so the
digest of chunk ``k`` covers chunks ``0..k``: equal digests mean equal prefixes.
``payload[k]`` is the chunk's token ids (little-endian int32) or, for engines that
already hash blocks (vLLM), the concatenated block hashes of the chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from lmc_server.cache.keys import DIGEST_BYTES

_SEED = bytes(DIGEST_BYTES)


def hash_chain(payloads: Iterable[bytes], seed: bytes = _SEED) -> bytes:
    """Concatenated chained digests of ``payloads`` (one 32-byte digest each)."""
    out = bytearray()
    prev = seed
    for p in payloads:
        prev = hashlib.blake2b(prev + p, digest_size=DIGEST_BYTES).digest()
        out += prev
    return bytes(out)


def chunk_digests(tokens: Sequence[int] | np.ndarray, chunk_size: int) -> bytes:
    """Digests of every *full* chunk of ``tokens`` (a trailing partial chunk is dropped)."""
    arr = np.asarray(tokens, dtype="<i4")
    n = len(arr) // chunk_size
    return hash_chain(arr[i * chunk_size : (i + 1) * chunk_size].tobytes() for i in range(n))
