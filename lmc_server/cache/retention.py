"""Retention: what one kind of section keeps of a prefix, and so what a hit needs of it.

Each engine group kind keeps a different part of a prefix's KV, and the rules that
follow from it (how many blocks of a chunk an object stores, which chunks of a prefix a
hit and a retrieve need, whether an object without the section is worth storing) are
those of the kind. So there is one class per kind, in the spirit of vLLM v1's
per-attention-type cache managers, instead of a window branch in every method:

* :class:`FullRetention` (full attention: DeepSeek-V4.1's compressed KV and its
  indexer): every block of every chunk. A ``k``-chunk prefix hits only if chunks
  ``0..k-1`` are all present, so the longest hit is bounded by the first missing chunk
  (a bound that holds for every shorter prefix too). Required: an object without these
  sections is useless to any hit, so it is not stored.
* :class:`WindowRetention` (sliding window of ``W`` tokens): only the trailing
  ``ceil(W / tokens_per_block)`` blocks of a chunk, and a ``k``-chunk prefix needs them
  only for its last ``ceil(W / chunk_size)`` chunks. Not prefix-closed: a prefix may
  hit while a shorter one does not (its window chunks were never stored). Optional: an
  object stores the window sections the engine still had.

A retention covers the sections of one object group that share its rule (``bits``,
``mask``: their section indices); :func:`object_retentions` builds them, required ones
first. The hit-rule methods read a partition's committed slots through ``row``, one int64
per chunk of the request: a slot, ``-1`` (not committed), or ``UNRESOLVED`` (not looked
up yet; window retentions resolve lazily only the chunks they check).

Invariant (tested): a retention never reports a hit whose needed sections are missing:
``hits_at(k)`` is true only if every chunk in ``first_needed(k)..k-1`` is committed with
every section bit of ``mask``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import ClassVar

import numpy as np

from lmc_server.cache.geometry import GroupSpec
from lmc_server.cache.pool import COMMITTED, Partition

#: ``row`` value of a chunk whose slot was not looked up yet.
UNRESOLVED = -2


def committed_slots(part: Partition, keys: list[bytes]) -> np.ndarray:
    """Committed slot of each key, or -1 (one C-level dict pass, then numpy)."""
    slots = np.fromiter(map(part.keys.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
    present = slots >= 0
    if present.any():
        state = np.frombuffer(part.state, dtype=np.int8)
        present[present] = state[slots[present]] == COMMITTED
        slots[~present] = -1
    return slots


class Retention(ABC):
    """The rule of one section kind over the sections ``bits`` of one object group.

    Subclasses are frozen dataclasses with ``bits`` first and ``mask`` (the bits as a
    section mask) derived: layouts holding them compare by value.
    """

    __slots__ = ()
    bits: tuple[int, ...]
    mask: int
    #: An object missing one of these sections is useless to any hit: not stored.
    required: ClassVar[bool]

    def _set_mask(self) -> None:
        assert self.bits, "a retention covers at least one section"
        object.__setattr__(self, "mask", sum(1 << b for b in self.bits))

    @staticmethod
    @abstractmethod
    def stored_blocks(group: GroupSpec, blocks_per_chunk: int) -> int:
        """Blocks of a chunk an object stores (the trailing ones of the chunk)."""

    @abstractmethod
    def first_needed(self, k: int) -> int:
        """First chunk of a ``k``-chunk prefix whose sections a hit and a retrieve need."""

    @abstractmethod
    def new_row(self, part: Partition, keys: list[bytes]) -> np.ndarray:
        """The slots row of a request, as the first retention of an object group
        starts it: resolved whole (a kind that reads every chunk) or ``UNRESOLVED``."""

    @abstractmethod
    def limit(self, part: Partition, keys: list[bytes], row: np.ndarray, k: int) -> int:
        """A bound ``<= k`` on the hit length that also holds for every shorter prefix
        (``k`` when this kind has no such bound). May resolve ``row``."""

    @abstractmethod
    def hits_at(self, part: Partition, keys: list[bytes], row: np.ndarray, k: int) -> bool:
        """Whether a ``k``-chunk prefix (``k`` within every :meth:`limit`) has these
        sections wherever it needs them. Resolves the chunks of ``row`` it reads."""

    @abstractmethod
    def mark_needed(self, need: np.ndarray, bounds: Sequence[tuple[int, int]]) -> None:
        """Set ``need[bit, i]`` for the chunks a retrieve reads of each section ``bit``;
        ``bounds`` are the ``(start, end)`` chunk ranges of the prefixes batched in it."""


@dataclass(frozen=True, slots=True)
class FullRetention(Retention):
    """Full attention: every block of every chunk, chunks ``0..k-1`` of a prefix."""

    bits: tuple[int, ...]
    mask: int = field(init=False, repr=False)
    required: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._set_mask()

    @staticmethod
    def stored_blocks(group: GroupSpec, blocks_per_chunk: int) -> int:
        return blocks_per_chunk

    def first_needed(self, k: int) -> int:
        return 0

    def new_row(self, part: Partition, keys: list[bytes]) -> np.ndarray:
        return committed_slots(part, keys)  # every chunk: the whole prefix is needed

    def limit(self, part: Partition, keys: list[bytes], row: np.ndarray, k: int) -> int:
        # Committed is enough: an object of a group with full sections is only ever
        # committed holding all of them (the store rule; L2 writes back L1's mask). An
        # UNRESOLVED row (this retention not first in its group) reads as a miss.
        first = np.flatnonzero(row[:k] < 0)
        return int(first[0]) if first.size else k

    def hits_at(self, part: Partition, keys: list[bytes], row: np.ndarray, k: int) -> bool:
        return True  # within limit() every chunk 0..k-1 has the sections

    def mark_needed(self, need: np.ndarray, bounds: Sequence[tuple[int, int]]) -> None:
        for bit in self.bits:  # basic indexing: no index arrays
            need[bit] = True


@dataclass(frozen=True, slots=True)
class WindowRetention(Retention):
    """Sliding window: trailing blocks of a chunk, the last ``chunks`` chunks of a prefix.

    ``chunks`` is ``ceil(W / chunk_size)``; sections whose windows round to the same
    number of chunks share one retention (the same chunks are checked for all of them).
    """

    bits: tuple[int, ...]
    chunks: int
    mask: int = field(init=False, repr=False)
    required: ClassVar[bool] = False

    def __post_init__(self) -> None:
        assert self.chunks > 0, "a window covers at least one chunk"
        self._set_mask()

    @staticmethod
    def stored_blocks(group: GroupSpec, blocks_per_chunk: int) -> int:
        return min(blocks_per_chunk, math.ceil(group.window_tokens / group.tokens_per_block))

    def first_needed(self, k: int) -> int:
        return k - self.chunks if k > self.chunks else 0

    def new_row(self, part: Partition, keys: list[bytes]) -> np.ndarray:
        return np.full(len(keys), UNRESOLVED, dtype=np.int64)

    def limit(self, part: Partition, keys: list[bytes], row: np.ndarray, k: int) -> int:
        return k

    def hits_at(self, part: Partition, keys: list[bytes], row: np.ndarray, k: int) -> bool:
        mask = self.mask
        masks = part.mask
        state = part.state
        get = part.keys.get
        for i in range(k - self.chunks if k > self.chunks else 0, k):
            s = int(row[i])
            if s == UNRESOLVED:
                s = get(keys[i], -1)
                if s >= 0 and state[s] != COMMITTED:
                    s = -1
                row[i] = s
            if s < 0 or (masks[s] & mask) != mask:
                return False
        return True

    def mark_needed(self, need: np.ndarray, bounds: Sequence[tuple[int, int]]) -> None:
        for lo, hi in bounds:
            first = max(lo, hi - self.chunks)
            for bit in self.bits:
                need[bit, first:hi] = True


#: Engine group kind -> its retention (scratch groups are never in an object).
KINDS: dict[str, type[Retention]] = {"full": FullRetention, "sliding_window": WindowRetention}


def retention_kind(group: GroupSpec) -> type[Retention]:
    return KINDS[group.kind]


def object_retentions(groups: Sequence[GroupSpec], chunk_size: int) -> tuple[Retention, ...]:
    """The retentions of an object group whose section ``i`` is ``groups[i]``: one full
    retention for every full section, one window retention per distinct number of window
    chunks; required (prefix-bounding) retentions first."""
    full: list[int] = []
    windows: dict[int, list[int]] = {}
    for bit, g in enumerate(groups):
        if retention_kind(g) is FullRetention:
            full.append(bit)
        else:
            windows.setdefault(math.ceil(g.window_tokens / chunk_size), []).append(bit)
    out: list[Retention] = [FullRetention(tuple(full))] if full else []
    out += [WindowRetention(tuple(bits), chunks) for chunks, bits in sorted(windows.items())]
    return tuple(out)
