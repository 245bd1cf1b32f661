"""The way down of a :class:`~lmc_server.server.server.Server`: signals, the drain and
releasing what startup built; the base class of ``Server``.

Apart from the lifecycle in ``server.py`` because it is a job of its own with its own
invariants, read on their own when a shutdown misbehaves:

- SIGINT and SIGTERM only ask for the exit (:meth:`ServerTeardown.handle_exit`); the
  main loop returns and :meth:`ServerTeardown.shutdown` runs on the loop thread.
- From the first line of the drain on, new requests are answered ``shutting_down``;
  in-flight requests get ``drain_timeout_s``; past it only running copies are waited
  for (they cannot be interrupted, and a retrieve's reply before its copy stops would
  let the engine reuse blocks still being written), nothing is committed visibly.
- Resources are released in reverse dependency order, and the release is safe after a
  startup that failed part of the way (every part may still be None or unset).
- The previous signal handlers are restored on exit, so a server embedded in tests
  behaves.

The attributes below are set by ``Server.__init__`` and ``Server.startup``; this class
only declares what it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmc_server.config import Config
from lmc_server.logs import reopen_logs
from lmc_server.server.dispatch import Dispatcher
from lmc_server.server.housekeeping import Housekeeper
from lmc_server.server.liveness import Liveness
from lmc_server.server.notify import Notifier
from lmc_server.server.router import Router
from lmc_server.server.sessions import SessionTable
from lmc_server.server.stats import ServerStats

if TYPE_CHECKING:
    from lmc_server.cache.index import L1Index
    from lmc_server.metrics.endpoint import MetricsServer
    from lmc_server.server.events.publisher import KvEventPublisher
    from lmc_server.server.handlers import Handlers
    from lmc_server.transfer.base import HostPool, TransferEngine

log = logging.getLogger(__name__)


class ServerTeardown:
    """Signal handling and shutdown for ``Server`` (see the module docstring)."""

    config: Config
    loop: asyncio.AbstractEventLoop
    notifier: Notifier
    dispatch: Dispatcher | None
    sessions: SessionTable
    stats: ServerStats
    should_exit: bool
    started: bool
    router: Router | None
    housekeeper: Housekeeper | None
    liveness: Liveness | None
    metrics_server: MetricsServer | None
    events: KvEventPublisher | None
    l2: Any
    engine: TransferEngine
    host_pool: HostPool
    index: L1Index
    handlers: Handlers
    on_shutdown: list[Callable[[Any], None]]
    _exit_event: asyncio.Event | None
    _prev_signals: dict[int, Any]

    @property
    def draining(self) -> bool:
        """Shutdown has begun: new requests are answered ``shutting_down`` (the
        dispatcher's flag: it reads it per request)."""
        return self.dispatch is not None and self.dispatch.draining

    # -- signals ------------------------------------------------------------------------

    def handle_exit(self) -> None:
        if not self.should_exit:
            log.info("shutdown requested")
        self.should_exit = True
        if self.housekeeper is not None:
            self.housekeeper.stop()
        if self._exit_event is not None:
            self._exit_event.set()

    def handle_hup(self) -> None:
        """SIGHUP: reopen log files (after rotation) and log where the server stands."""
        files = reopen_logs()
        log.info(
            "SIGHUP: %s; %s",
            f"reopened {', '.join(files)}" if files else "logging to stderr, nothing to reopen",
            self.liveness.status_line()
            if self.started and self.liveness is not None
            else "starting",
        )

    def _install_signal_handlers(self) -> None:
        handlers = {
            signal.SIGINT: self.handle_exit,
            signal.SIGTERM: self.handle_exit,
            signal.SIGHUP: self.handle_hup,
        }
        for sig, handler in handlers.items():
            try:
                self._prev_signals[sig] = signal.getsignal(sig)
                self.loop.add_signal_handler(sig, handler)
            except (ValueError, RuntimeError):  # not the main thread
                self._prev_signals.pop(sig, None)

    def _restore_signal_handlers(self) -> None:
        for sig, prev in self._prev_signals.items():
            with contextlib.suppress(ValueError, RuntimeError):
                self.loop.remove_signal_handler(sig)
                signal.signal(sig, prev)
        self._prev_signals.clear()

    # -- shutdown -----------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop taking work, let copies finish, answer the rest, release everything."""
        assert self.dispatch is not None  # built by a startup that returned
        self.dispatch.draining = True
        tasks = self.dispatch.tasks
        self.notifier.stopping(f"draining {len(tasks)} in-flight requests")
        for cb in self.on_shutdown:
            cb(self)
        if tasks:
            log.info(
                "draining %d in-flight requests (up to %.0f s)",
                len(tasks),
                self.config.drain_timeout_s,
            )
            _, pending = await asyncio.wait(set(tasks), timeout=self.config.drain_timeout_s)
            if pending:
                # From here on only running copies are waited for: copies still queued
                # in the engine are not started, stores waiting on another writer's
                # chunks stop waiting (settle); nothing else can delay the end.
                self.engine.stop_queued()
                self.handlers.commits.close()
                self.dispatch.answer_unfinished(pending)
                await asyncio.wait(pending)
        assert self.router is not None
        self.router.drain()  # answer what is still queued with shutting_down
        st = self.index.stats
        log.info(
            "served %d requests; %d of %d looked-up chunks hit; %d objects stored, "
            "%d retrieved, %d evicted",
            sum(dict(self.stats.requests).values()),
            st.hit_chunks,
            st.lookup_chunks,
            st.stored_objects,
            st.retrieved_objects,
            st.evictions,
        )
        await self._close_resources()
        log.info("shutdown complete")

    async def _close_resources(self) -> None:
        """Release what startup built, in reverse dependency order; safe after a startup
        that failed part of the way."""
        if self.l2 is not None:  # before the pool goes: its threads read and fill slots
            # What was committed is written out first, within the drain timeout.
            await self.l2.stop(self.config.drain_timeout_s if self.started else 0.0)
        if self.housekeeper is not None:
            self.housekeeper.stop()
        if self.liveness is not None:
            self.liveness.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.router is not None:
            self.router.close_socket()
        if self.events is not None:
            self.events.close()
        for session in self.sessions.sessions():
            self.sessions.drop(session)
        pool = getattr(self, "host_pool", None)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        elif pool is not None:
            pool.close()
        if self.router is not None:
            self.router.terminate()
        self.notifier.close()
