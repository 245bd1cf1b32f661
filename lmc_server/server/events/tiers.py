"""KV events of the disk tier (``--disk-dir``): the same blocks, medium ``DISK``.

The disk tier tells its listeners (:mod:`lmc_server.tiers.events`) when a write is
complete and when it deletes a file (evicted for capacity, found missing or damaged).
Those are published on the object's topic as ``BlockStored`` and ``BlockRemoved`` with
medium ``DISK`` and the hashes its L1 object was published with, so a router sees one
more tier of blocks it already knows. A disk object is published only if its L1 object
was published when the write completed (the write reads it from L1, so it is there):
the same namespaces, object groups and stores (not salted) as in L1, and every removal
names an object a ``BlockStored`` announced. Files found on disk at start, or written
by another server sharing the directory, are not announced.

The stored events carry no tokens and no parent: a router that learnt the blocks from
their L1 (or GPU) events, as llm-d's indexer does, files them under the new tier by
their hashes; one that needs tokens to index a block (Dynamo) ignores them. The Redis
or Mooncake L2 tier is not published: those stores evict on their own, unseen, so their
removals could not be. Per object held on disk this keeps its key and encoded hashes
(about 200 bytes at 16-token blocks). Loop thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from lmc_server.protocol import kv_events as ev

#: ``medium`` of objects in the disk tier.
MEDIUM_DISK = "DISK"


class Publisher(Protocol):
    """What the disk tier's events need of ``events.KvEventPublisher``, which builds
    :class:`DiskEvents`: named here so that this module does not import it back."""

    chunk_size: int

    def topic_of(self, prefix: bytes) -> bytes | None: ...

    def published_hashes(self, key: bytes) -> tuple[bool, bytes | None]: ...

    def digest_hash(self, key: bytes) -> int: ...

    def append(self, topic: bytes, event: Any) -> None: ...

    def remove(self, topic: bytes, key: bytes, hashes: bytes | None, medium: str) -> None: ...


class DiskEvents:
    """Maps the disk tier's keys back to published L1 objects and publishes them."""

    def __init__(self, publisher: Publisher) -> None:
        from lmc_server.tiers import codec  # the L2 package loads only with a lower tier

        self.publisher = publisher
        self._codec = codec
        self._space_at = len(codec.KEY_PREFIX)
        self._key_at = self._space_at + codec.SPACE_BYTES
        #: the L2 space of a watched object group -> its L1 key prefix
        self._spaces: dict[bytes, bytes] = {}
        #: disk key of every object announced as on disk -> its encoded hashes (None:
        #: derived from the digest)
        self._held: dict[bytes, bytes | None] = {}

    def __len__(self) -> int:
        return len(self._held)

    def watch(self, namespace: str, fingerprint: bytes, prefix: bytes) -> None:
        space = self._codec.space_of(namespace, fingerprint, self.publisher.chunk_size)
        self._spaces[space] = prefix

    def _l1_key(self, key: bytes) -> tuple[bytes, bytes] | None:
        """The topic and L1 key of a disk key, or None when not watched."""
        prefix = self._spaces.get(key[self._space_at : self._key_at])
        if prefix is None:
            return None
        topic = self.publisher.topic_of(prefix)
        return None if topic is None else (topic, prefix + key[self._key_at :])

    def stored(self, kind: str, keys: Sequence[bytes]) -> None:
        for key in keys:
            found = self._l1_key(key)
            if found is None or key in self._held:
                continue
            topic, l1_key = found
            published, hashes = self.publisher.published_hashes(l1_key)
            if not published:
                continue
            self._held[key] = hashes
            cs = self.publisher.chunk_size
            if hashes is None:
                event = ev.BlockStored(
                    block_hashes=[self.publisher.digest_hash(l1_key)],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=cs,
                    lora_id=None,
                    medium=MEDIUM_DISK,
                    lora_name=None,
                )
            else:
                n = len(hashes) // ev.U64_ELEMENT_BYTES
                event = ev.BlockStored(
                    block_hashes=ev.raw_array(hashes, n),
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=cs // n,
                    lora_id=None,
                    medium=MEDIUM_DISK,
                    lora_name=None,
                )
            self.publisher.append(topic, event)

    def removed(self, kind: str, keys: Sequence[bytes], reason: str) -> None:
        for key in keys:
            if key not in self._held:
                continue
            hashes = self._held.pop(key)
            found = self._l1_key(key)
            assert found is not None, "a held disk object's group is watched"
            topic, l1_key = found
            self.publisher.remove(topic, l1_key, hashes, MEDIUM_DISK)
