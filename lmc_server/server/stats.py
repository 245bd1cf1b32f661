"""Server-level counters: requests by operation and outcome, transfers, tokens.

Plain ints and lists, incremented on the hot path; the metrics layer reads them at
scrape time (no Prometheus objects are touched per request).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the transfer-duration histogram buckets.
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                      2.5, 5.0)


@dataclass
class TransferStats:
    """One direction: count, bytes, seconds, and a cumulative-able bucket histogram."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS_S) + 1))

    def observe(self, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.seconds += seconds
        self.buckets[bisect.bisect_left(TRANSFER_BUCKETS_S, seconds)] += 1


@dataclass
class ServerStats:
    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    lookup_tokens: int = 0
    hit_tokens: int = 0
    transfers: dict[str, TransferStats] = field(
        default_factory=lambda: {"store": TransferStats(), "retrieve": TransferStats()})
    sessions_reaped: int = 0

    def count_request(self, op: str, outcome: str) -> None:
        key = (op, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transfers[direction].observe(nbytes, seconds)
