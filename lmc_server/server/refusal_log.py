"""Refused requests in the log, at most a few lines per client and minute.

Every refusal is counted (``lmc_requests_total{op,status}``) and answered; the log gets
the first :data:`REFUSALS_LOGGED` of each client in every :data:`REFUSAL_LOG_INTERVAL_S`,
then one line that says how many more there were, by code. Why: a client that repeats a
refused request in a loop (a connector built for another chunk size, a fuzzer, a worker
stuck on an out-of-range block id) would otherwise write a line per message, thousands a
second, into the journal; under ``tests/protocol/test_fuzz.py``'s storm the server spent about
30 % of its time formatting those lines (profiled).

Invariants: a client's first refusal in an interval is always logged; no refusal goes
missing from the log either (a summary line reports the rest, by code, at the first
housekeeping tick or refusal after the interval, also for a client gone meanwhile); the
state is one entry per client refused in the current interval, so it cannot grow with
time.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from lmc_server.protocol.errors import ProtocolError
from lmc_server.server.sessions import Session

log = logging.getLogger(__name__)

#: Refusal lines logged per client per interval; the rest are summarized.
REFUSALS_LOGGED = 10
#: The interval (the server's clock, seconds).
REFUSAL_LOG_INTERVAL_S = 60.0


@dataclass
class _Window:
    started_s: float
    name: str
    logged: int = 0
    unlogged: Counter[str] = field(default_factory=Counter)


class RefusalLog:
    """Logs refusals per client (by session), :data:`REFUSALS_LOGGED` per interval."""

    def __init__(
        self,
        clock: Callable[[], float],
        per_interval: int = REFUSALS_LOGGED,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
    ) -> None:
        self.clock = clock
        self.per_interval = per_interval
        self.interval_s = interval_s
        self._windows: dict[int, _Window] = {}

    def refused(self, session: Session, op: str, e: ProtocolError) -> None:
        now = self.clock()
        name = session.client_name or "client"
        w = self._windows.get(session.sid)
        if w is not None and now - w.started_s >= self.interval_s:
            self._summarize(w)
            w = None
        if w is None:
            w = self._windows[session.sid] = _Window(now, name)
        if w.logged < self.per_interval:
            w.logged += 1
            log.info("refused %s from %s: %s: %s", op, name, e.code.value, e.message)
            if w.logged == self.per_interval:
                log.info(
                    "%s: %d requests refused within %.0f s; further refusals in this "
                    "interval are counted and summarized, not logged one by one",
                    name,
                    self.per_interval,
                    self.interval_s,
                )
        else:
            w.unlogged[e.code.value] += 1

    def tick(self, now_s: float) -> None:
        """Summarize and forget the windows that are over (the housekeeping tick)."""
        over = [sid for sid, w in self._windows.items() if now_s - w.started_s >= self.interval_s]
        for sid in over:
            self._summarize(self._windows.pop(sid))

    def _summarize(self, w: _Window) -> None:
        n = sum(w.unlogged.values())
        if n:
            codes = ", ".join(f"{code} {k}" for code, k in sorted(w.unlogged.items()))
            log.info(
                "%s: %d more requests refused in %.0f s, not logged one by one (%s)",
                w.name,
                n,
                self.interval_s,
                codes,
            )


__all__ = ["REFUSALS_LOGGED", "REFUSAL_LOG_INTERVAL_S", "RefusalLog"]
