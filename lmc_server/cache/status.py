"""Per-chunk outcome codes, one byte per chunk on the wire (``bytes`` of these)."""

from __future__ import annotations

from enum import IntEnum


class ChunkStatus(IntEnum):
    """What happened to one chunk of one object group in a store or retrieve.

    ``OK``, ``EXISTS`` and ``NOT_AVAILABLE`` are not failures: the chunk is (or stays)
    as good as the request could make it. Every other value is a failure of exactly
    that chunk; nothing about it became visible.
    """

    OK = 0
    EXISTS = 1  # store: already committed by someone; nothing copied
    IN_PROGRESS = 2  # store: another writer holds this key right now
    NOT_AVAILABLE = 3  # store: the blocks a hit needs were not given (-1); skipped
    NO_SPACE = 4  # store: pool full and nothing evictable
    FAILED = 5  # the copy failed or the writer went away; nothing visible
    MISS = 6  # retrieve: not in L1 (never stored, evicted, or section absent)
    SKIPPED = 7  # retrieve: nothing to copy (outside the window, or every block -1)


SUCCESS = frozenset(
    {ChunkStatus.OK, ChunkStatus.EXISTS, ChunkStatus.NOT_AVAILABLE, ChunkStatus.SKIPPED}
)
