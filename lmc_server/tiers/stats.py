"""L2 counters: plain ints bumped on the event loop, read at scrape and ``stats`` time.

The counters themselves are defined once, in :class:`lmc_server.cache.counters.L2Counters`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from lmc_server.cache.counters import L2Counters

#: Upper bounds of the L2 round-trip latency histogram buckets.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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


class L2Stats(L2Counters, kw_only=True):
    """The tier's counters (defined once in :class:`~lmc_server.cache.counters.L2Counters`)
    and its round-trip latency histograms."""

    read_latency: Latency = msgspec.field(default_factory=Latency)
    write_latency: Latency = msgspec.field(default_factory=Latency)
