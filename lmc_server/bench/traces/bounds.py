"""Hit-ratio bounds of a trace: an infinite cache, and Belady's offline optimum.

Both use the server's hit rule: a request hits the longest prefix of its chunks that
is cached when it arrives, and every chunk of the request is cached after it.

Belady (MIN) at a capacity of ``capacity`` objects: when the cache overflows, evict
the chunk whose next use is farthest in the future, the incoming chunks included (so a
chunk never used again is not kept at all). Digests are prefix-chained, so a chunk is
never next used after its own descendants' next use; with ties broken by position
(deeper chunks come later) the cache therefore stays prefix-closed, and the chunks it
holds of a request are exactly a prefix. MIN maximises cached-object hits over all
policies; since a prefix hit counts only cached objects, it bounds every policy's
prefix hits too. The heap holds ``(-next use, chunk)`` with lazy deletion: a popped
entry whose next use is no longer the chunk's current one is stale and skipped.
"""

from __future__ import annotations

import heapq


def infinite_hits(requests: list[list[int]]) -> list[int]:
    """Hit chunks per request with unbounded capacity."""
    seen: set[int] = set()
    out = []
    for chunks in requests:
        h = 0
        while h < len(chunks) and chunks[h] in seen:
            h += 1
        out.append(h)
        seen.update(chunks)
    return out


def next_uses(requests: list[list[int]]) -> list[int]:
    """For every reference (flattened in request order), the position of the next
    reference to the same chunk; never-again references get ``len + position`` (so
    they are farther than any real use, and distinct)."""
    flat = [c for chunks in requests for c in chunks]
    n = len(flat)
    out = [0] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        c = flat[i]
        out[i] = last.get(c, n + i)
        last[c] = i
    return out


def belady_hits(requests: list[list[int]], capacity: int) -> list[int]:
    """Hit chunks per request for MIN with ``capacity`` objects (>= 0)."""
    nxt = next_uses(requests)
    cached: dict[int, int] = {}  # chunk -> its current next use
    heap: list[tuple[int, int]] = []
    out = []
    pos = 0
    for chunks in requests:
        h = 0
        while h < len(chunks) and chunks[h] in cached:
            h += 1
        out.append(h)
        for c in chunks:
            nu = nxt[pos]
            pos += 1
            cached[c] = nu
            heapq.heappush(heap, (-nu, c))
            while len(cached) > capacity:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
        if len(heap) > 4 * max(capacity, 1) + 1024:  # drop stale entries now and then
            heap = [(-nu, c) for c, nu in cached.items()]
            heapq.heapify(heap)
    return out
