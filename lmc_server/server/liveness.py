"""Where the server stands, for systemd and ``/healthz``: heartbeat, watchdog, STATUS.

The heartbeat is an event-loop timer, so a stuck loop is what stops it: ``/healthz``
fails once the last beat is :data:`HEALTH_STALL_S` old (by the server's clock), and
systemd's watchdog trips when the ``WATCHDOG=1`` pings sent from the beat stop. The
beat also refreshes systemd's ``STATUS=`` line while serving; while the pool is being
prepared, each prepared slab refreshes it (:meth:`Liveness.slab_ready`), so
``systemctl status`` shows the progress. Everything here runs on the loop thread, except
reading :attr:`Liveness.heartbeat_s` (a float, from the metrics thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from lmc_server.cache.index import L1Index
from lmc_server.config import Config, gib_text
from lmc_server.server.notify import Notifier
from lmc_server.server.sessions import SessionTable

log = logging.getLogger(__name__)

#: The event loop's heartbeat period; /healthz fails once a beat is this late.
HEARTBEAT_INTERVAL_S = 1.0
HEALTH_STALL_S = 10.0
#: How often systemd's STATUS= line is refreshed (pool preparation, then usage).
STATUS_INTERVAL_S = 1.0
SERVING_STATUS_INTERVAL_S = 10.0


class Liveness:
    """The heartbeat and the STATUS lines of one server.

    ``draining`` says whether shutdown has begun: no serving STATUS line then (the
    drain's own line stays), and slabs prepared late are not marked ready.
    """

    def __init__(
        self,
        config: Config,
        loop: asyncio.AbstractEventLoop,
        clock: Callable[[], float],
        notifier: Notifier,
        index: L1Index,
        sessions: SessionTable,
        draining: Callable[[], bool],
        started_at_s: float,
    ) -> None:
        self.config = config
        self.loop = loop
        self.clock = clock
        self.notifier = notifier
        self.index = index
        self.sessions = sessions
        self.draining = draining
        self.started_at_s = started_at_s
        #: When the loop last beat (``clock`` time).
        self.heartbeat_s = 0.0
        #: When every slab was prepared, or None while preparing.
        self.pool_ready_at_s: float | None = None
        self._status_at_s = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def heartbeat(self) -> None:
        """Event-loop liveness for /healthz and the systemd watchdog; runs until
        :meth:`stop` (also while draining, so a long drain does not trip the watchdog)."""
        now = self.clock()
        self.heartbeat_s = now
        if self.notifier.watchdog_interval_s:
            self.notifier.watchdog()
        if (
            not self.draining()
            and self.pool_ready_at_s is not None
            and now - self._status_at_s >= SERVING_STATUS_INTERVAL_S
        ):
            self._status_at_s = now
            self.notifier.status(self.status_line())
        interval_s = HEARTBEAT_INTERVAL_S
        if self.notifier.watchdog_interval_s:
            interval_s = min(interval_s, self.notifier.watchdog_interval_s)
        self._handle = self.loop.call_later(interval_s, self.heartbeat)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def stalled_s(self) -> float:
        """Seconds since the last beat, by the server's clock."""
        return self.clock() - self.heartbeat_s

    def status_line(self) -> str:
        idx, st = self.index, self.index.stats
        used = idx.used_bytes
        ratio = st.hit_chunks / st.lookup_chunks if st.lookup_chunks else 0.0
        return (
            f"serving: {self.sessions.registrations} registrations, L1 "
            f"{gib_text(used)} of {gib_text(idx.pool_usage().capacity_bytes)} "
            f"used, chunk hit ratio {ratio:.0%}, {st.evictions} evictions"
        )

    def slab_ready_threadsafe(self, slab: int) -> None:
        """The host pool's preparing thread reports a slab (see ``HostPool.start``)."""
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            self.loop.call_soon_threadsafe(self.slab_ready, slab)

    def slab_ready(self, slab: int) -> None:
        """Hand a prepared slab to the index (on the loop thread, the index's only);
        log and tell systemd how far the pool is."""
        if self.draining():
            return
        self.index.slab_ready(slab)
        pool = self.index.pool_usage()
        if pool.ready_slabs == pool.slabs:
            self.pool_ready_at_s = self.clock()
            log.info(
                "L1 pool ready: %d slabs (%s) in %.2f s",
                pool.slabs,
                gib_text(pool.capacity_bytes),
                self.pool_ready_at_s - self.started_at_s,
            )
            self._status_at_s = self.pool_ready_at_s
            self.notifier.status(
                f"serving on {self.config.endpoint}; L1 pool ready "
                f"({gib_text(pool.capacity_bytes)})"
            )
        elif self.notifier.enabled and self.clock() - self._status_at_s >= STATUS_INTERVAL_S:
            self._status_at_s = self.clock()
            self.notifier.status(
                f"serving on {self.config.endpoint}; preparing L1 pool: "
                f"{gib_text(pool.ready_bytes)} of "
                f"{gib_text(pool.capacity_bytes)} "
                f"({pool.ready_slabs / pool.slabs:.0%})"
            )
