"""The server lifecycle: ``serve -> startup -> main loop -> shutdown``.

:class:`Server` builds the parts and runs them; each part has its own module:

- :mod:`~lmc_server.server.router`: the zmq ROUTER socket on the event loop;
- :mod:`~lmc_server.server.dispatch`: frames to handler calls and replies;
- :mod:`~lmc_server.server.handlers`: what each request means (index, engine);
- :mod:`~lmc_server.server.housekeeping`: leases, idle sessions, the eviction log;
- :mod:`~lmc_server.server.liveness`: heartbeat, systemd watchdog and STATUS lines;
- :mod:`~lmc_server.server.teardown`: the signals and the way down (the base class).

Signals: SIGINT and SIGTERM start a graceful shutdown (new requests are answered
``shutting_down``, in-flight copies get ``drain_timeout_s`` to finish, mappings are
closed, the pool is freed), then the process exits 0. Past the timeout, stores still
copying are answered ``shutting_down`` at once (they are never committed visibly: no
request is served after the drain), copies still queued in the engine are not started
(cpu engine; the cuda engine's queued lane jobs still run), stores waiting for another
writer's chunks stop waiting, and the server waits for running copies only (they
cannot be interrupted);
retrieves are answered when their copy stops,
because it writes into the engine's memory and a reply before that would let the
engine reuse blocks still being written. SIGHUP reopens the log file (see
:mod:`lmc_server.logs`) and logs a one-line summary; nothing else is reloaded. The
previous handlers are restored on exit, so a server embedded in tests behaves.

Operations wiring: the metrics endpoint (``/metrics``, ``/healthz``) starts with the
sockets; systemd is told ``READY=1`` as soon as both are bound (the pool is prepared
in the background and reported with ``STATUS=`` lines), ``WATCHDOG=1`` from the
event-loop heartbeat and ``STOPPING=1`` when the drain starts.

Time: everything the server decides by time (lease expiry, idle sessions, uptime, the
health stall) reads ``clock``; tests inject a fake one
(:mod:`lmc_server.testing.inprocess`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import zmq

from lmc_server import __version__
from lmc_server.cache.index import L1Index
from lmc_server.config import Config, gib_text
from lmc_server.protocol.stats import StatsReport
from lmc_server.server.dispatch import Dispatcher
from lmc_server.server.handlers import Handlers
from lmc_server.server.housekeeping import HOUSEKEEPING_INTERVAL_S, Housekeeper
from lmc_server.server.liveness import HEALTH_STALL_S, Liveness
from lmc_server.server.notify import Notifier
from lmc_server.server.peers import Conn, ConnectionTracker
from lmc_server.server.report import build_report
from lmc_server.server.router import Router
from lmc_server.server.sessions import SessionTable
from lmc_server.server.stats import ServerStats
from lmc_server.server.teardown import ServerTeardown
from lmc_server.threadnames import name_os_thread
from lmc_server.tiers.url import redact_url
from lmc_server.transfer.base import HostPool, TransferEngine
from lmc_server.transfer.select import make_engine

if TYPE_CHECKING:
    from lmc_server.metrics.endpoint import MetricsServer
    from lmc_server.server.events.publisher import KvEventPublisher

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILURE = 3


class Server(ServerTeardown):
    """One L1 cache daemon. ``run()`` blocks until shutdown and returns an exit code.

    ``engine``, ``clock`` and ``notifier`` replace the configured transfer engine, the
    monotonic clock and systemd's notification socket (tests); the parts built at
    startup (``index``, ``handlers``, ...) are attributes for tests and diagnostics.
    """

    def __init__(
        self,
        config: Config,
        engine: TransferEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
        notifier: Notifier | None = None,
        housekeeping_interval_s: float = HOUSEKEEPING_INTERVAL_S,
    ) -> None:
        self.config = config
        self._engine = engine
        self.clock = clock
        self.notifier = Notifier.from_env() if notifier is None else notifier
        self.metrics_server: MetricsServer | None = None
        self.should_exit = False
        self.started = False
        self.stats = ServerStats()
        self.sessions = SessionTable()
        self.started_at_s = 0.0
        self.peers = ConnectionTracker()
        self.dispatch: Dispatcher | None = None
        self.router: Router | None = None
        self.housekeeping_interval_s = housekeeping_interval_s
        self.housekeeper: Housekeeper | None = None
        self.liveness: Liveness | None = None
        self._exit_event: asyncio.Event | None = None
        self._prev_signals: dict[int, Any] = {}
        self.on_started: list[Callable[[Server], None]] = []
        self.on_shutdown: list[Callable[[Server], None]] = []
        self.l2: Any = None  # lmc_server.tiers.chain.TierChain with --l2 or --disk-dir
        self.events: KvEventPublisher | None = None  # with --kv-events-endpoint

    @property
    def housekeeping_ticks(self) -> int:
        """Housekeeping ticks run so far (tests, diagnostics)."""
        return 0 if self.housekeeper is None else self.housekeeper.ticks

    @property
    def pool_ready_at_s(self) -> float | None:
        """When every slab of the pool was prepared (``clock`` time), or None."""
        return None if self.liveness is None else self.liveness.pool_ready_at_s

    # -- entry points -------------------------------------------------------------------

    def run(self) -> int:
        try:
            import uvloop

            runner: Callable[..., int] = uvloop.run
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            runner = asyncio.run
        return runner(self.serve())

    async def serve(self) -> int:
        self.loop = asyncio.get_running_loop()
        # run_in_executor(None, ...) threads carry an OS name too (threadnames.py)
        self.loop.set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="lmc-aio", initializer=name_os_thread)
        )
        self._exit_event = asyncio.Event()
        self._install_signal_handlers()
        try:
            try:
                await self.startup()
            except (OSError, zmq.ZMQError, RuntimeError, ValueError) as e:
                log.error("startup failed: %s", e)
                self.notifier.status(f"startup failed: {e}")
                await self._close_resources()
                return EXIT_STARTUP_FAILURE
            await self.main_loop()
            await self.shutdown()
            return EXIT_OK
        finally:
            self._restore_signal_handlers()

    # -- startup ------------------------------------------------------------------------

    async def startup(self) -> None:
        cfg = self.config
        self.started_at_s = self.clock()
        log.info("lmcache server %s starting: %s", __version__, _describe(cfg))
        self.engine = self._engine or make_engine(
            cfg.backend, cfg.copy_threads, cfg.cuda_copy_mode, cfg.cuda_staging_mb
        )
        self.host_pool: HostPool = self.engine.create_pool(cfg.l1_size_bytes, cfg.slab_bytes)
        self.index = L1Index(self.host_pool.size_bytes, cfg.slab_bytes, cfg.eviction_policy)
        if self.host_pool.size_bytes < cfg.l1_size_bytes:
            log.info(
                "L1 size %s rounded down to whole slabs of %d MiB: %s (a multiple of "
                "%g GiB is used whole)",
                gib_text(cfg.l1_size_bytes),
                cfg.slab_size_mb,
                gib_text(self.host_pool.size_bytes),
                cfg.slab_bytes / (1 << 30),
            )
        # Each part is built complete, from the parts built before it: the tiers and
        # the publisher, the router, the handlers (which read all three), the
        # dispatcher (handlers and router); then the router starts reading into it.
        if cfg.l2_url or cfg.disk_dir:
            from lmc_server.tiers.setup import make_chain

            self.l2 = make_chain(cfg, self.index, self.host_pool, self.engine.name, self.clock)
            self.l2.start()
        if cfg.kv_events_endpoint:
            from lmc_server.server.events.publisher import KvEventPublisher
            from lmc_server.server.events.settings import kv_event_settings

            self.events = KvEventPublisher(kv_event_settings(cfg), self.loop, cfg.chunk_size)
            self.events.open()
            disk = self.l2.tier("disk") if self.l2 is not None else None
            if disk is not None:
                self.events.attach_disk(disk.listeners)
        router = self.router = Router(cfg, self.loop, self.peers, self._disconnected)
        self.handlers = Handlers(
            cfg,
            self.index,
            self.engine,
            self.sessions,
            self.stats,
            self.clock,
            l2=self.l2,
            events=self.events,
            before_commit=router.drain_monitor,
        )
        dispatch = self.dispatch = Dispatcher(
            cfg,
            self.loop,
            self.handlers,
            router,
            self.sessions,
            self.stats,
            self.clock,
            self.report,
        )
        router.open(dispatch.handle)
        if cfg.metrics_port:
            self._start_metrics()
        self.liveness = Liveness(
            cfg,
            self.loop,
            self.clock,
            self.notifier,
            self.index,
            self.sessions,
            lambda: self.draining,
            self.started_at_s,
        )
        self.host_pool.start(self.liveness.slab_ready_threadsafe)
        self.housekeeper = Housekeeper(
            self.loop,
            self.clock,
            self.index,
            self.sessions,
            self.handlers.drop_session,
            self.housekeeping_interval_s,
            self._tick,
        )
        if not self.should_exit:  # no tick once shutdown is asked for
            self.housekeeper.start()
        self.liveness.heartbeat()
        self.started = True
        log.info(
            "listening on %s (backend %s, L1 %s = %d slabs of %d MiB, "
            "eviction %s, chunk size %d, %s object groups)",
            cfg.endpoint,
            self.engine.name,
            gib_text(self.host_pool.size_bytes),
            self.index.pool_usage().slabs,
            cfg.slab_size_mb,
            cfg.eviction_policy,
            cfg.chunk_size,
            "separate" if cfg.separate_object_groups else "combined",
        )
        self.notifier.ready(
            f"serving on {cfg.endpoint}; preparing L1 pool ({gib_text(self.host_pool.size_bytes)})"
        )
        if self.notifier.enabled:
            log.info(
                "systemd notified: ready%s",
                ""
                if self.notifier.watchdog_interval_s is None
                else f", watchdog every {self.notifier.watchdog_interval_s:.1f} s",
            )
        for cb in self.on_started:
            cb(self)
        router.drain()

    def _start_metrics(self) -> None:
        # imported here: prometheus_client and http.server are about a tenth of the
        # daemon's import time, and a server without --metrics-port needs neither
        from lmc_server.metrics.collector import (
            CounterCollector,
            LiveState,
            ServerCollector,
            ServerInfo,
        )
        from lmc_server.metrics.endpoint import MetricsServer
        from lmc_server.metrics.registry import make_registry

        cfg = self.config
        assert self.dispatch is not None
        tasks = self.dispatch.tasks
        collector = ServerCollector(
            ServerInfo(
                backend=self.engine.name,
                eviction_policy=cfg.eviction_policy,
                chunk_size=cfg.chunk_size,
                object_groups="separate" if cfg.separate_object_groups else "combined",
            ),
            self.index,
            self.stats,
            self.sessions,
            LiveState(health=self.health, in_flight=lambda: len(tasks)),
        )
        registry = make_registry(collector)
        if self.l2 is not None:
            from lmc_server.tiers.metrics import L2Collector

            for tier in self.l2.tiers:
                registry.register(L2Collector(tier))
        if self.events is not None:
            registry.register(CounterCollector("lmcache_kv_events_", self.events.stats))
        self.metrics_server = MetricsServer(
            cfg.metrics_host, cfg.metrics_port, registry, self.health
        )
        self.metrics_server.start()

    def _tick(self, now_s: float) -> None:
        """The housekeeping tick's time-based checks: stores waiting past the settle
        timeout give up; refusal summaries of the interval just over are logged."""
        self.handlers.commits.expire(now_s)
        assert self.dispatch is not None
        self.dispatch.refusals.tick(now_s)

    def _disconnected(self, conn: Conn, identities: list[bytes]) -> None:
        """A connection closed: drop the sessions that still live on it, reclaiming
        everything they held (see :mod:`lmc_server.server.peers`)."""
        for identity in identities:
            session = self.sessions.get(identity)
            if session is not None and session.conn == conn:
                self.handlers.drop_session(session, "connection closed")

    def health(self) -> tuple[bool, str]:
        """``(serving, one-line reason)`` for /healthz; safe to call from any thread."""
        if self.draining or self.should_exit:
            return False, "draining: shutting down, new requests are refused"
        if not self.started or self.liveness is None:
            return False, "starting: sockets not bound yet"
        pool = self.index.pool_usage()
        if pool.ready_slabs == 0:
            return False, "starting: no L1 slab prepared yet"
        late_s = self.liveness.stalled_s()
        if late_s > HEALTH_STALL_S:
            return False, f"event loop unresponsive for {late_s:.0f} s"
        return True, (
            f"serving on {self.config.endpoint}, L1 pool "
            f"{pool.ready_slabs / pool.slabs:.0%} prepared, "
            f"{self.sessions.registrations} registrations"
            + (f", {self.l2.health()}" if self.l2 is not None else "")
        )

    # -- main loop ----------------------------------------------------------------------

    async def main_loop(self) -> None:
        assert self._exit_event is not None
        await self._exit_event.wait()

    def report(self) -> StatsReport:
        """The ``stats`` reply (see :mod:`lmc_server.server.report`)."""
        return build_report(
            self.config,
            self.engine.name,
            self.index,
            self.sessions,
            self.stats,
            self.clock() - self.started_at_s,
            self.l2,
            self.events,
        )


def _describe(cfg: Config) -> str:
    """Every effective setting, ``name=value``, for the startup log line (the L2 URL
    through :func:`redact_url`, like every URL shown)."""
    values = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    values["l2_url"] = redact_url(cfg.l2_url) if cfg.l2_url else ""
    values["l1_size_bytes"] = cfg.l1_size_bytes
    # the size asked for (resolved from the machine where not given), as typed
    values["l1_size_gb"] = float(f"{cfg.l1_size_bytes / (1 << 30):.6g}")
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())
