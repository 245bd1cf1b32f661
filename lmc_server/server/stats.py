"""Server-level counters: requests by operation and outcome, transfers, tokens.

Plain ints and lists, incremented on the hot path; the metrics layer reads them at
scrape time (no Prometheus objects are touched per request).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from lmc_server.metrics.buckets import TRANSFER_BUCKETS_S

_perf_counter = time.perf_counter


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


#: Phases of a store or retrieve, in order; each ends at a :meth:`PhaseClock.mark`.
#: ``queue``: from the request's arrival (before decoding) until its handler runs;
#: ``prepare``: checks and index bookkeeping; ``submit``: the engine's planning and
#: launch (both on the event loop; a large request alternates the two, one sub-batch
#: at a time, and each phase is the sum of its spans); ``copy``: from the last
#: submission until the engine reported the last byte landed; ``hop_out``: from that
#: report until the event loop resumed the request; ``finish``: commit, encode and send
#: the reply. Requests that copy nothing have only ``queue``, ``prepare`` and
#: ``finish``; refused requests are not counted.
PHASES = ("queue", "prepare", "submit", "copy", "hop_out", "finish")


class PhaseClock:
    """Where one data request's time goes inside the server.

    ``mark(phase)`` adds the time since the previous mark to ``phase``; ``mark_at``
    does the same up to a time taken elsewhere (the engine thread's completion).
    Only the event loop marks.
    """

    __slots__ = ("last", "spans")

    def __init__(self, start_s: float) -> None:
        self.last = start_s
        self.spans: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        t = _perf_counter()  # monotonic: never before the last mark
        spans = self.spans
        spans[phase] = spans.get(phase, 0.0) + (t - self.last)
        self.last = t

    def mark_at(self, phase: str, t: float) -> None:
        t = max(t, self.last)
        self.spans[phase] = self.spans.get(phase, 0.0) + (t - self.last)
        self.last = t


@dataclass
class ServerStats:
    """The server's structured counters (by request, transfer and phase); its scalar
    ones are in :class:`~lmc_server.cache.counters.CacheStats` (the one list of
    counters)."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    transfers: dict[str, TransferStats] = field(
        default_factory=lambda: {"store": TransferStats(), "retrieve": TransferStats()}
    )
    #: (op, phase) -> [requests, seconds], see ``PHASES``.
    phases: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def count_request(self, op: str, outcome: str) -> None:
        key = (op, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe_transfer(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transfers[direction].observe(nbytes, seconds)

    def observe_phases(self, op: str, clock: PhaseClock) -> None:
        for phase, seconds in clock.spans.items():
            acc = self.phases.get((op, phase))
            if acc is None:
                self.phases[(op, phase)] = [1, seconds]
            else:
                acc[0] += 1
                acc[1] += seconds
