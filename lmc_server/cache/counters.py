"""The cache core's monotonic counters, incremented on the hot path, read at scrape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CacheStats:
    """Monotonic counters; the hot path only increments ints (exported at scrape)."""

    lookups: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    stored_objects: int = 0
    stored_bytes: int = 0
    retrieved_objects: int = 0
    retrieved_bytes: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    slabs_moved: int = 0
    leases_taken: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    alloc_failures: dict[str, int] = field(default_factory=dict)
