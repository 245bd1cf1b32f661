"""What one registration sees of the cache, and the hit rule over it.

A :class:`CacheView` is a registration's namespace (its key prefix), its layout and one
partition per object group. The hit rule combines the retentions of every object group
(:mod:`lmc_server.cache.retention`): a prefix of ``k`` chunks hits when every object
group with full-prefix sections has chunks ``0..k-1`` committed with those sections,
and every sliding window W has its sections present for the last ``ceil(W / chunk_size)``
chunks of the prefix. :func:`hit_chunks` finds the largest such ``k``;
:func:`needed_slots` names exactly the objects a retrieve of that prefix reads (what a
lease pins).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.layout import RegistrationLayout
from lmc_server.cache.pool import Partition
from lmc_server.cache.retention import FullRetention, Retention


@dataclass(frozen=True, slots=True)
class CacheView:
    """What one registration sees: its namespace and one partition per object group.

    Made by :meth:`~lmc_server.cache.index.L1Index.view` and handed back to the index
    with every request. ``ns_prefix`` and ``layout`` are the registration's to read;
    ``_partitions`` are the core's: read by the index and the modules behind it (the hit
    rule here, store, retrieve, reservation), changed only by them, so that every slot
    transition goes through the index.
    """

    ns_prefix: bytes
    layout: RegistrationLayout
    _partitions: tuple[Partition, ...]


def hit_chunks(view: CacheView, keys: list[bytes]) -> tuple[int, list[np.ndarray]]:
    """Length of the longest hit prefix, and per object group the slots looked up.

    ``slots[og][i]`` is the committed slot of chunk ``i``, -1, or
    :data:`~lmc_server.cache.retention.UNRESOLVED`: object groups with full sections are
    resolved for every chunk, window-only ones only for the chunks the window rule
    looked at. Every chunk a hit of the returned length needs
    is resolved. Prefix-bounding retentions first (one vectorized pass each), then the
    longest prefix within that bound that every window accepts.
    """
    n = len(keys)
    limit = n
    rows: list[np.ndarray] = []
    checks = []
    for og, part in zip(view.layout.object_groups, view._partitions, strict=True):
        row = og.retentions[0].new_row(part, keys)
        for r in og.retentions:
            limit = r.limit(part, keys, row, limit)
            checks.append((r.hits_at, part, row))
        rows.append(row)
    for k in range(limit, 0, -1):
        for hits_at, part, row in checks:
            if not hits_at(part, keys, row, k):
                break
        else:
            return k, rows
    return 0, rows


def prompt_hits(view: CacheView, keys: list[bytes], ends: list[int]) -> list[int]:
    """:func:`hit_chunks` of each prompt ``keys[ends[i-1]:ends[i]]`` (a probe's batch),
    with one dict pass per partition for the whole batch.

    The prefix bound of a :class:`~lmc_server.cache.retention.FullRetention` (the first
    chunk whose slot is not committed) is found for every prompt at once with numpy; the
    other retentions run per prompt on slices of the same rows, as in
    :func:`hit_chunks`, so the two agree (``tests/cache/test_probe.py`` checks it).
    """
    n = len(keys)
    his = np.asarray(ends, dtype=np.int64)
    los = np.concatenate(([0], his[:-1])) if len(his) else his
    limit = his - los
    rest: list[tuple[Retention, Partition, np.ndarray]] = []
    for og, part in zip(view.layout.object_groups, view._partitions, strict=True):
        row = og.retentions[0].new_row(part, keys)
        for r in og.retentions:
            if isinstance(r, FullRetention):
                missing = np.flatnonzero(row < 0)
                at = np.searchsorted(missing, los)
                first = np.append(missing, n)[at]
                limit = np.minimum(limit, np.minimum(first, his) - los)
            else:
                rest.append((r, part, row))
    if not rest:
        return [int(k) for k in limit]
    out = []
    for lo, hi, bound in zip(los.tolist(), his.tolist(), limit.tolist(), strict=True):
        ks = keys[lo:hi]
        segs = [(r, part, row[lo:hi]) for r, part, row in rest]
        for r, part, seg in segs:
            bound = r.limit(part, ks, seg, bound)
        k = bound
        while k > 0 and not all(r.hits_at(part, ks, seg, k) for r, part, seg in segs):
            k -= 1
        out.append(k)
    return out


def needed_slots(view: CacheView, slots: list[np.ndarray], k: int) -> list[tuple[Partition, array]]:
    """Slots a retrieve of the ``k``-chunk prefix reads, per partition (``slots`` as
    :func:`hit_chunks` returned them for a hit of ``k`` chunks)."""
    out = []
    for og, part in zip(view.layout.object_groups, view._partitions, strict=True):
        first = min(r.first_needed(k) for r in og.retentions)
        out.append((part, array("i", slots[og.index][first:k].astype(np.int32).tobytes())))
    return out
