"""L2 counters: plain ints bumped on the event loop, read at scrape and ``stats`` time."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Upper bounds of the L2 round-trip latency histogram buckets.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5)


@dataclass(slots=True)
class Latency:
    """A histogram without a lock: bucket counts, total count and sum of seconds."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    count: int = 0
    seconds: float = 0.0

    def observe(self, s: float) -> None:
        i = 0
        while i < len(LATENCY_BUCKETS_S) and s > LATENCY_BUCKETS_S[i]:
            i += 1
        self.buckets[i] += 1
        self.count += 1
        self.seconds += s


@dataclass(slots=True)
class L2Stats:
    """Monotonic counters of the L2 tier (objects are one chunk of one object group)."""

    hits: int = 0  # objects found valid in L2 and committed to L1
    misses: int = 0  # objects asked of L2 and absent
    invalid: dict[str, int] = field(default_factory=dict)  # by codec.Invalid value
    bytes_read: int = 0
    bytes_written: int = 0
    objects_written: int = 0
    dropped_writes: dict[str, int] = field(default_factory=dict)  # by reason
    errors: dict[str, int] = field(default_factory=dict)  # by operation
    prefetches: int = 0
    prefetches_skipped: int = 0  # too many in flight
    prefetch_no_space: int = 0  # objects L1 had no room for
    read_latency: Latency = field(default_factory=Latency)
    write_latency: Latency = field(default_factory=Latency)
    state_changes: int = 0

    @staticmethod
    def bump(counter: dict[str, int], reason: str, n: int = 1) -> None:
        counter[reason] = counter.get(reason, 0) + n
