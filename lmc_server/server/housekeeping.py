"""Housekeeping: the jobs the server does by time, not by request.

One tick every :data:`HOUSEKEEPING_INTERVAL_S` (a loop timer) expires leases and tells
``on_tick`` the time (stores waiting for another writer give up by it); when due,
it also forgets idle sessions and logs a summary of evictions. "Due" and "expired" are
decided by the server's clock (``clock``, ``time.monotonic`` unless a test injects a
fake one), the tick's period by the event loop: a test that moves a fake clock sees
the effect at the next tick, milliseconds later with a short period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from lmc_server.cache.index import L1Index
from lmc_server.server.sessions import Session, SessionTable

log = logging.getLogger(__name__)

#: The housekeeping tick: leases are checked for expiry on every tick, the slower jobs
#: below when they are due. One timer handle, rescheduled by the tick itself.
HOUSEKEEPING_INTERVAL_S = 0.25
#: How often idle sessions are looked for, and how long one holding nothing may idle.
SESSION_SWEEP_INTERVAL_S = 5.0
IDLE_SESSION_S = 60.0
#: How often evictions and allocation failures are summarized in one log line.
EVICTION_LOG_INTERVAL_S = 60.0


class Housekeeper:
    """The housekeeping tick. Invariant: at most one timer handle is held, so a server
    idle for months holds no growing list of timers (``tests/server/test_housekeeping.py``).

    ``drop_session`` reclaims what an idle session held (the handlers' job);
    ``on_tick`` is told the clock's time on every tick (the settle timeout's check).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        clock: Callable[[], float],
        index: L1Index,
        sessions: SessionTable,
        drop_session: Callable[[Session, str], None],
        interval_s: float,
        on_tick: Callable[[float], None] = lambda now_s: None,
    ) -> None:
        self.loop = loop
        self.clock = clock
        self.index = index
        self.sessions = sessions
        self.drop_session = drop_session
        self.on_tick = on_tick
        self.interval_s = interval_s
        #: Ticks run so far (tests, diagnostics).
        self.ticks = 0
        self._handle: asyncio.TimerHandle | None = None
        self._stopped = False
        #: When the slower jobs are next due (``clock`` time).
        self._due: dict[str, float] = {}
        self._eviction_mark = (0, 0, 0)

    def start(self) -> None:
        now = self.clock()
        self._due = {
            "sessions": now + SESSION_SWEEP_INTERVAL_S,
            "evictions": now + EVICTION_LOG_INTERVAL_S,
        }
        self._handle = self.loop.call_later(self.interval_s, self._tick)

    def stop(self) -> None:
        """No tick runs after this (the server is shutting down)."""
        self._stopped = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        """One tick: expire leases; forget idle sessions and log evictions when due."""
        self._handle = None
        if self._stopped:
            return
        self.ticks += 1
        now = self.clock()
        self._sweep_leases()
        self.on_tick(now)
        if now >= self._due["sessions"]:
            self._due["sessions"] = now + SESSION_SWEEP_INTERVAL_S
            self._sweep_sessions()
        if now >= self._due["evictions"]:
            self._due["evictions"] = now + EVICTION_LOG_INTERVAL_S
            self._log_evictions()
        self._handle = self.loop.call_later(self.interval_s, self._tick)

    def _sweep_leases(self) -> None:
        n = self.index.expire_leases(self.clock())
        if n:
            log.debug("%d leases expired", n)

    def _sweep_sessions(self) -> None:
        """Forget sessions that hold no registration, said nothing for a while, and have
        no tracked connection. A session whose connection is up is never dropped for
        being quiet: the socket monitor drops it when the connection closes."""
        cutoff = self.clock() - IDLE_SESSION_S
        for s in self.sessions.sessions():
            if not s.registrations and s.conn is None and s.last_seen_s < cutoff:
                self.drop_session(s, "idle")

    def _log_evictions(self) -> None:
        """One line per interval with evictions or allocation failures (none: silent)."""
        st = self.index.stats
        failures = sum(st.alloc_failures.values())
        mark = (st.evictions, st.evicted_bytes, failures)
        d_ev, d_bytes, d_fail = (a - b for a, b in zip(mark, self._eviction_mark, strict=True))
        self._eviction_mark = mark
        if d_ev or d_fail:
            used = self.index.used_bytes
            pool = self.index.pool_usage()
            log.info(
                "last %.0f s: %d objects evicted (%.1f MiB), %d allocation failures; "
                "L1 %.1f of %.1f GiB used, %d free slabs",
                EVICTION_LOG_INTERVAL_S,
                d_ev,
                d_bytes / (1 << 20),
                d_fail,
                used / (1 << 30),
                pool.capacity_bytes / (1 << 30),
                pool.free_slabs,
            )
