"""Index keys: the namespace id and each digest side by side, salted or not.

Long runs of unsalted digests take a table-and-unpack path; it must give exactly the
keys of the plain rule (``namespace prefix + digest``, in order) at every length around
its threshold and beyond, for any namespace id, and refusals must stay what they were.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from lmc_server.cache.keys import (
    DIGEST_BYTES,
    MAX_SALT_BYTES,
    STRUCT_KEYS_MIN,
    chunk_keys,
    namespace_prefix,
)


def _plain(prefix: bytes, digests: bytes) -> list[bytes]:
    return [prefix + digests[i : i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES)]


@pytest.mark.parametrize("ns_id", [1, 2, 255, 256, 2**31 + 5])
def test_unsalted_keys_follow_the_plain_rule_at_every_length(ns_id: int) -> None:
    prefix = namespace_prefix(ns_id)
    for n in [*range(0, 2 * STRUCT_KEYS_MIN + 2), 255, 256, 257, 1000]:
        digests = os.urandom(DIGEST_BYTES * n)
        keys = chunk_keys(prefix, digests)
        assert keys == _plain(prefix, digests), n
        assert all(type(k) is bytes for k in keys)
    assert chunk_keys(prefix, digests) == chunk_keys(prefix, digests)  # a known length again


def test_namespaces_never_share_a_key_on_either_path() -> None:
    digests = os.urandom(DIGEST_BYTES * (STRUCT_KEYS_MIN + 3))
    a, b = chunk_keys(namespace_prefix(1), digests), chunk_keys(namespace_prefix(2), digests)
    assert not set(a) & set(b)
    assert not set(a[:2]) & set(chunk_keys(namespace_prefix(2), digests[: 2 * DIGEST_BYTES]))


def test_salted_keys_and_refusals_are_unchanged() -> None:
    prefix = namespace_prefix(3)
    digests = os.urandom(DIGEST_BYTES * (STRUCT_KEYS_MIN + 1))
    salted = chunk_keys(prefix, digests, b"tenant")
    assert salted == [
        prefix + hashlib.blake2b(d, key=b"tenant", digest_size=DIGEST_BYTES).digest()
        for d in (digests[i : i + DIGEST_BYTES] for i in range(0, len(digests), DIGEST_BYTES))
    ]
    assert not set(salted) & set(chunk_keys(prefix, digests))
    with pytest.raises(ValueError, match="multiple"):
        chunk_keys(prefix, digests + b"x")
    with pytest.raises(ValueError, match="salt"):
        chunk_keys(prefix, digests, b"s" * (MAX_SALT_BYTES + 1))
