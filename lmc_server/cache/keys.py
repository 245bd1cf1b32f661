"""Index keys: namespace, chunk digest and cache salt in, one ``bytes`` key per chunk out.

A key is ``namespace id (NS_BYTES, little endian) | chunk digest (DIGEST_BYTES)``. A
non-empty cache salt replaces each digest by ``blake2b(digest, key=salt)`` (a salt over
64 bytes, blake2b's key limit, is hashed to 32 bytes first), so two tenants with
different salts never share a key even for the same tokens. Namespaces with the same
layout share a partition's slots but never a key: the namespace id is part of it.

``DIGEST_BYTES`` is defined here once: the wire codec, the client's digest chain and
the index all read it from this module.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

#: Bytes of one chunk digest (blake2b-256), on the wire and in every key.
DIGEST_BYTES = 32
#: Bytes of the namespace id that prefixes every key.
NS_BYTES = 4
#: Longest cache salt accepted.
MAX_SALT_BYTES = 256
_BLAKE2B_MAX_KEY_BYTES = 64


def namespace_prefix(ns_id: int) -> bytes:
    """The key prefix of namespace ``ns_id`` (interned ids start at 1)."""
    return ns_id.to_bytes(NS_BYTES, "little")


def chunk_keys(ns_prefix: bytes, digests: bytes, salt: bytes = b"") -> list[bytes]:
    """The index keys of a run of chunk digests (``DIGEST_BYTES`` each).

    Raises ``ValueError`` for a ragged digest run or a salt over ``MAX_SALT_BYTES``.
    """
    if len(salt) > MAX_SALT_BYTES:
        raise ValueError(f"cache salt longer than {MAX_SALT_BYTES} bytes")
    if len(digests) % DIGEST_BYTES:
        raise ValueError(f"digests must be a multiple of {DIGEST_BYTES} bytes")
    starts = range(0, len(digests), DIGEST_BYTES)
    if not salt:
        n = len(digests) // DIGEST_BYTES
        if n >= STRUCT_KEYS_MIN and len(ns_prefix) == NS_BYTES:
            return _unsalted_keys(ns_prefix, digests, n)
        return [ns_prefix + digests[i : i + DIGEST_BYTES] for i in starts]
    key = (
        hashlib.blake2b(salt, digest_size=DIGEST_BYTES).digest()
        if len(salt) > _BLAKE2B_MAX_KEY_BYTES
        else salt
    )
    return [
        ns_prefix
        + hashlib.blake2b(digests[i : i + DIGEST_BYTES], key=key, digest_size=DIGEST_BYTES).digest()
        for i in starts
    ]


#: From this many chunks :func:`chunk_keys` builds unsalted keys with one numpy copy and
#: one ``struct`` unpack (256 keys: about 15 us against 49 us for slicing and joining
#: each, 2-core VM); below it the plain loop is faster.
STRUCT_KEYS_MIN = 16
_KEY_BYTES = NS_BYTES + DIGEST_BYTES
#: ``struct.Struct`` of ``n`` keys, by ``n`` (bounded: requests have at most a few
#: thousand chunks, and an unknown count is only a slower path)
_KEY_STRUCTS: dict[int, struct.Struct] = {}
_KEY_STRUCTS_MAX = 512


def _unsalted_keys(ns_prefix: bytes, digests: bytes, n: int) -> list[bytes]:
    """``[ns_prefix + digest for each digest]``: the keys laid out side by side in one
    buffer (namespace column, digest columns), cut into ``n`` bytes objects by one
    unpack, in C."""
    st = _KEY_STRUCTS.get(n)
    if st is None:
        st = struct.Struct(f"{_KEY_BYTES}s" * n)
        if len(_KEY_STRUCTS) < _KEY_STRUCTS_MAX:
            _KEY_STRUCTS[n] = st
    table = np.empty((n, _KEY_BYTES), dtype=np.uint8)
    table[:, :NS_BYTES] = np.frombuffer(ns_prefix, dtype=np.uint8)
    table[:, NS_BYTES:] = np.frombuffer(digests, dtype=np.uint8).reshape(n, DIGEST_BYTES)
    return list(st.unpack(table.tobytes()))
