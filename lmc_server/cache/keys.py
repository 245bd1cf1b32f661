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
