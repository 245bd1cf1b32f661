"""The server lifecycle: ``serve -> startup -> main loop -> shutdown``.

The zmq ROUTER socket is driven directly from the event loop (``add_reader`` on its
file descriptor, non-blocking ``recv``/``send``) instead of through ``zmq.asyncio``:
one readiness callback drains every queued message, so the control path costs one
decode, one handler call and one send per request, with no future per message.
zmq's descriptor is edge-triggered, hence :meth:`Server._after_io` after every send.

Signals: SIGINT and SIGTERM start a graceful shutdown (new requests are answered
``shutting_down``, in-flight copies get ``drain_timeout_s`` to finish, mappings are
closed, the pool is freed), then the process exits 0. Past the timeout, stores still
copying are answered ``shutting_down`` at once (they are never committed visibly: no
request is served after the drain); retrieves are answered when their copy stops,
because it writes into the engine's memory and a reply before that would let the
engine reuse blocks still being written. SIGHUP reopens the log file (see
:mod:`lmc_server.logs`) and logs a one-line summary; nothing else is reloaded. The
previous handlers are restored on exit, so a server embedded in tests behaves.

Operations wiring: the metrics endpoint (``/metrics``, ``/healthz``) starts with the
sockets; systemd is told ``READY=1`` as soon as both are bound (the pool is prepared
in the background and reported with ``STATUS=`` lines), ``WATCHDOG=1`` from an
event-loop timer (so a stuck loop is what trips the watchdog) and ``STOPPING=1`` when
the drain starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from lmc_server import __version__
from lmc_server.cache.index import L1Index
from lmc_server.cache.pool import SlabPool
from lmc_server.config import Config
from lmc_server.logs import reopen_logs
from lmc_server.metrics import (
    LiveState,
    MetricsServer,
    ServerCollector,
    ServerInfo,
    make_registry,
)
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_request, encode, error_reply
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.protocol.stats import StatsReport
from lmc_server.server.handlers import Handlers
from lmc_server.server.notify import Notifier
from lmc_server.server.peers import ConnectionTracker
from lmc_server.server.report import build_report
from lmc_server.server.security import bind_ipc, start_curve
from lmc_server.server.sessions import Session, SessionTable
from lmc_server.server.stats import PhaseClock, ServerStats
from lmc_server.transfer.base import HostPool, TransferEngine
from lmc_server.transfer.select import make_engine

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILURE = 3
#: Messages handled per readiness callback before yielding to other tasks.
DRAIN_BUDGET = 256
#: The housekeeping tick: leases are checked for expiry on every tick, the slower jobs
#: below when they are due. One timer handle, rescheduled by the tick itself.
HOUSEKEEPING_INTERVAL_S = 0.25
#: How often idle sessions are looked for, and how long one holding nothing may idle.
SESSION_SWEEP_INTERVAL_S = 5.0
IDLE_SESSION_S = 60.0
#: Messages a peer may send before hello; past that it is ignored (no amplification).
PRE_HELLO_MESSAGES = 16
#: zmq drops (disconnects) peers whose frames exceed this multiple of max_frame_bytes.
HARD_FRAME_FACTOR = 4
#: The event loop's heartbeat period; /healthz fails once a beat is this late.
HEARTBEAT_INTERVAL_S = 1.0
HEALTH_STALL_S = 10.0
#: How often systemd's STATUS= line is refreshed (pool preparation, then usage).
STATUS_INTERVAL_S = 1.0
SERVING_STATUS_INTERVAL_S = 10.0
#: How often evictions and allocation failures are summarized in one log line.
EVICTION_LOG_INTERVAL_S = 60.0

_SYNC_HANDLERS: dict[type, str] = {
    m.Hello: "hello", m.Register: "register", m.Unregister: "unregister",
    m.Lookup: "lookup", m.Release: "release", m.Ping: "ping", m.Clear: "clear",
}
_ASYNC_HANDLERS: dict[type, str] = {m.Store: "store", m.Retrieve: "retrieve"}


class Server:
    """One L1 cache daemon. ``run()`` blocks until shutdown and returns an exit code."""

    def __init__(self, config: Config, engine: TransferEngine | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 notifier: Notifier | None = None,
                 housekeeping_interval_s: float = HOUSEKEEPING_INTERVAL_S) -> None:
        self.config = config
        self._engine = engine
        self.clock = clock
        self.notifier = Notifier.from_env() if notifier is None else notifier
        self.metrics_server: MetricsServer | None = None
        self._heartbeat_s = 0.0
        self._heartbeat_handle: asyncio.TimerHandle | None = None
        self._status_at_s = 0.0
        self._eviction_mark = (0, 0, 0)
        #: Tasks already answered ``shutting_down`` at the drain timeout (no second reply).
        self._answered: set[asyncio.Task[None]] = set()
        #: Who to answer for each store/retrieve task: (identity, operation, req_id).
        self._task_requests: dict[asyncio.Task[None], tuple[bytes, str, int]] = {}
        self.should_exit = False
        self.started = False
        self.draining = False
        self.stats = ServerStats()
        self.sessions = SessionTable()
        self.started_at_s = 0.0
        self.pool_ready_at_s: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.peers = ConnectionTracker()
        self._auth: Any = None
        self.housekeeping_interval_s = housekeeping_interval_s
        self._housekeeping_handle: asyncio.TimerHandle | None = None
        #: When the slower housekeeping jobs are next due (``clock`` time).
        self._due: dict[str, float] = {}
        #: Housekeeping ticks run so far (tests, diagnostics).
        self.housekeeping_ticks = 0
        self._exit_event: asyncio.Event | None = None
        self._prev_signals: dict[int, Any] = {}
        self.on_started: list[Callable[[Server], None]] = []
        self.on_shutdown: list[Callable[[Server], None]] = []
        self.l2: Any = None  # lmc_server.l2.tier.L2Tier with --l2

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
        self.engine = self._engine or make_engine(cfg.backend, cfg.copy_threads,
                                                 cfg.cuda_copy_mode)
        if cfg.pipeline_mb >= 0:
            self.engine.pipeline_bytes = cfg.pipeline_mb << 20
        self.host_pool: HostPool = self.engine.create_pool(cfg.l1_size_bytes, cfg.slab_bytes)
        self.slab_pool = SlabPool(self.host_pool.size_bytes, cfg.slab_bytes)
        self.index = L1Index(self.slab_pool, cfg.eviction_policy)
        self.handlers = Handlers(cfg, self.index, self.engine, self.sessions, self.stats,
                                 self.clock)
        self.handlers.before_commit = self._drain
        if cfg.l2_url:
            from lmc_server.l2.setup import make_tier

            self.l2 = self.handlers.l2 = make_tier(cfg, self.index, self.host_pool,
                                                   self.engine.name)
            self.l2.start()
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # dual-stack: --host ::1 and IPv6 names bind
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes * HARD_FRAME_FACTOR)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        hb_ms = int(cfg.heartbeat_timeout_s * 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, hb_ms // 4))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, hb_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, hb_ms)
        self.sock = sock
        if cfg.curve_secret_key_file:
            self._auth = start_curve(self.ctx, sock, cfg.curve_secret_key_file,
                                     cfg.curve_clients_dir)
        sock.bind(cfg.endpoint)
        if cfg.ipc_path:
            bind_ipc(sock, cfg.ipc_path, cfg.ipc_group)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor_fd = int(self.monitor.getsockopt(zmq.FD))
        self.loop.add_reader(self._monitor_fd, self._drain_monitor)
        self._fd = int(sock.getsockopt(zmq.FD))
        self.loop.add_reader(self._fd, self._drain)
        if cfg.metrics_port:
            self._start_metrics()
        self.host_pool.start(self._slab_ready_threadsafe)
        now = self.clock()
        self._due = {"sessions": now + SESSION_SWEEP_INTERVAL_S,
                     "evictions": now + EVICTION_LOG_INTERVAL_S}
        self._housekeeping_handle = self.loop.call_later(self.housekeeping_interval_s,
                                                         self._housekeep)
        self._heartbeat()
        self.started = True
        log.info("listening on %s (backend %s, L1 %.1f GiB in %d slabs of %d MiB, "
                 "eviction %s, chunk size %d, %s object groups)", cfg.endpoint,
                 self.engine.name, self.host_pool.size_bytes / (1 << 30),
                 self.slab_pool.n_slabs, cfg.slab_size_mb, cfg.eviction_policy,
                 cfg.chunk_size, "separate" if cfg.separate_object_groups else "combined")
        self.notifier.ready(f"serving on {cfg.endpoint}; preparing L1 pool "
                            f"({self.host_pool.size_bytes / (1 << 30):.1f} GiB)")
        if self.notifier.enabled:
            log.info("systemd notified: ready%s", "" if self.notifier.watchdog_interval_s
                     is None else f", watchdog every {self.notifier.watchdog_interval_s:.1f} s")
        for cb in self.on_started:
            cb(self)
        self._drain()

    def _start_metrics(self) -> None:
        cfg = self.config
        collector = ServerCollector(
            ServerInfo(backend=self.engine.name, eviction_policy=cfg.eviction_policy,
                       chunk_size=cfg.chunk_size,
                       object_groups="separate" if cfg.separate_object_groups else "combined"),
            self.index, self.slab_pool, self.stats, self.sessions,
            LiveState(health=self.health, in_flight=lambda: len(self._tasks)))
        registry = make_registry(collector)
        if self.l2 is not None:
            from lmc_server.l2.metrics import L2Collector

            registry.register(L2Collector(self.l2))
        self.metrics_server = MetricsServer(cfg.metrics_host, cfg.metrics_port,
                                            registry, self.health)
        self.metrics_server.start()

    def health(self) -> tuple[bool, str]:
        """``(serving, one-line reason)`` for /healthz; safe to call from any thread."""
        if self.draining or self.should_exit:
            return False, "draining: shutting down, new requests are refused"
        if not self.started:
            return False, "starting: sockets not bound yet"
        pool = self.slab_pool
        if pool.ready_slabs == 0:
            return False, "starting: no L1 slab prepared yet"
        late_s = self.clock() - self._heartbeat_s
        if late_s > HEALTH_STALL_S:
            return False, f"event loop unresponsive for {late_s:.0f} s"
        return True, (f"serving on {self.config.endpoint}, L1 pool "
                      f"{pool.ready_slabs / pool.n_slabs:.0%} prepared, "
                      f"{self.sessions.registrations} registrations"
                      + (f", {self.l2.health()}" if self.l2 is not None else ""))

    def _heartbeat(self) -> None:
        """Event-loop liveness for /healthz and the systemd watchdog; runs until closed
        (also while draining, so a long drain does not trip the watchdog)."""
        now = self.clock()
        self._heartbeat_s = now
        if self.notifier.watchdog_interval_s:
            self.notifier.watchdog()
        if (not self.draining and self.pool_ready_at_s is not None
                and now - self._status_at_s >= SERVING_STATUS_INTERVAL_S):
            self._status_at_s = now
            self.notifier.status(self._status_line())
        interval_s = HEARTBEAT_INTERVAL_S
        if self.notifier.watchdog_interval_s:
            interval_s = min(interval_s, self.notifier.watchdog_interval_s)
        self._heartbeat_handle = self.loop.call_later(interval_s, self._heartbeat)

    def _status_line(self) -> str:
        idx, st = self.index, self.index.stats
        used = sum(p.used_bytes for p in list(idx.partitions.values()))
        ratio = st.hit_chunks / st.lookup_chunks if st.lookup_chunks else 0.0
        return (f"serving: {self.sessions.registrations} registrations, L1 "
                f"{used / (1 << 30):.1f} of {self.slab_pool.capacity_bytes / (1 << 30):.1f} "
                f"GiB used, chunk hit ratio {ratio:.0%}, {st.evictions} evictions")

    def _log_evictions(self) -> None:
        """One line per interval with evictions or allocation failures (none: silent)."""
        st = self.index.stats
        failures = sum(st.alloc_failures.values())
        mark = (st.evictions, st.evicted_bytes, failures)
        d_ev, d_bytes, d_fail = (a - b for a, b in zip(mark, self._eviction_mark, strict=True))
        self._eviction_mark = mark
        if d_ev or d_fail:
            used = sum(p.used_bytes for p in self.index.partitions.values())
            log.info("last %.0f s: %d objects evicted (%.1f MiB), %d allocation failures; "
                     "L1 %.1f of %.1f GiB used, %d free slabs", EVICTION_LOG_INTERVAL_S,
                     d_ev, d_bytes / (1 << 20), d_fail, used / (1 << 30),
                     self.slab_pool.capacity_bytes / (1 << 30), self.slab_pool.free_slabs)

    def _slab_ready_threadsafe(self, slab: int) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed during shutdown
            self.loop.call_soon_threadsafe(self._slab_ready, slab)

    def _slab_ready(self, slab: int) -> None:
        if self.draining:
            return
        pool = self.slab_pool
        pool.mark_ready(slab)
        if pool.ready_slabs == pool.n_slabs:
            self.pool_ready_at_s = self.clock()
            log.info("L1 pool ready: %d slabs (%.1f GiB) in %.2f s", pool.n_slabs,
                     pool.capacity_bytes / (1 << 30),
                     self.pool_ready_at_s - self.started_at_s)
            self._status_at_s = self.pool_ready_at_s
            self.notifier.status(f"serving on {self.config.endpoint}; L1 pool ready "
                                 f"({pool.capacity_bytes / (1 << 30):.1f} GiB)")
        elif self.notifier.enabled and self.clock() - self._status_at_s >= STATUS_INTERVAL_S:
            self._status_at_s = self.clock()
            self.notifier.status(f"serving on {self.config.endpoint}; preparing L1 pool: "
                                 f"{pool.ready_bytes / (1 << 30):.1f} of "
                                 f"{pool.capacity_bytes / (1 << 30):.1f} GiB "
                                 f"({pool.ready_slabs / pool.n_slabs:.0%})")

    def _housekeep(self) -> None:
        """One tick: expire leases; forget idle sessions and log evictions when due.

        The tick reschedules itself and keeps only that one handle, so a server idle for
        months holds no growing list of timers (``tests/test_housekeeping.py``).
        """
        self._housekeeping_handle = None
        if self.should_exit:
            return
        self.housekeeping_ticks += 1
        now = self.clock()
        self._sweep_leases()
        if now >= self._due["sessions"]:
            self._due["sessions"] = now + SESSION_SWEEP_INTERVAL_S
            self._sweep_sessions()
        if now >= self._due["evictions"]:
            self._due["evictions"] = now + EVICTION_LOG_INTERVAL_S
            self._log_evictions()
        self._housekeeping_handle = self.loop.call_later(self.housekeeping_interval_s,
                                                         self._housekeep)

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
                self.handlers.drop_session(s, "idle")

    # -- main loop ----------------------------------------------------------------------

    async def main_loop(self) -> None:
        assert self._exit_event is not None
        await self._exit_event.wait()

    def _drain(self) -> None:
        """Handle every queued message (up to a budget, then yield and continue)."""
        sock = self.sock
        if not sock.closed:
            self._drain_monitor()
        for _ in range(DRAIN_BUDGET):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if sock.closed:
                    return
                log.warning("receive failed: %s", e)
                return
            self._handle(frames)
        self.loop.call_soon(self._drain)

    def _after_io(self) -> None:
        if not self.sock.closed and int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self.loop.call_soon(self._drain)

    def _send(self, identity: bytes, payload: bytes) -> None:
        if self.sock.closed:
            return
        try:
            self.sock.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("reply dropped: peer %s is not reading (send queue full)",
                        identity.hex()[:8])
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                log.debug("reply to a peer that is gone dropped")
            else:
                log.warning("send failed: %s", e)

    def _drain_monitor(self) -> None:
        """Connection events: a connection that goes away (crash, kill -9, closed
        socket, or silent past the heartbeat timeout) takes its sessions with it, and
        everything they held is reclaimed at once (see :mod:`lmc_server.server.peers`).
        """
        while True:
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.ZMQError:  # Again included: nothing queued
                return
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self.peers.accepted(fd)
                continue
            conn, identities = self.peers.closed(fd)
            for identity in identities:
                session = self.sessions.get(identity)
                if session is not None and session.conn == conn:
                    self.stats.sessions_reaped += 1
                    self.handlers.drop_session(session, "connection closed")

    def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return
        t_recv = time.perf_counter()
        identity = frames[0].bytes
        payload = [f.bytes for f in frames[1:]]
        session = self.sessions.get_or_create(identity, self.clock())
        if session.conn is None:
            self._drain_monitor()  # its accept may have been queued after this drain began
            session.conn = self.peers.attribute(identity, int(frames[0].get(zmq.SRCFD)))
        op = "invalid"
        try:
            if not session.hello:
                session.pre_hello += 1
                if session.pre_hello > PRE_HELLO_MESSAGES:
                    if session.pre_hello == PRE_HELLO_MESSAGES + 1:
                        log.warning("peer %s sent %d messages without hello: ignoring it",
                                    identity.hex()[:8], PRE_HELLO_MESSAGES)
                    return
            msg = decode_request(payload, self.handlers.limits)
            op = type(msg).__name__.lower()
            if not session.hello and not isinstance(msg, m.Hello | m.Ping):
                raise ProtocolError(ErrorCode.HANDSHAKE, "send hello first", msg.req_id)
            if self.draining:
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "server is shutting down",
                                    msg.req_id)
            if isinstance(msg, m.Stats):
                reply: m.Reply = m.StatsResult(req_id=msg.req_id, stats=self.report())
            elif (name := _SYNC_HANDLERS.get(type(msg))) is not None:
                reply = getattr(self.handlers, name)(session, msg)
            else:
                if (isinstance(msg, m.Store | m.Retrieve)  # unknown ids: not "busy"
                        and self.sessions.find(session, msg.registration_id) is None):
                    raise ProtocolError(ErrorCode.UNKNOWN_REGISTRATION,
                                        "no such registration on this connection", msg.req_id)
                if session.inflight >= self.config.max_inflight_per_client:
                    raise ProtocolError(
                        ErrorCode.BUSY, f"{session.inflight} requests in flight on this "
                        f"connection; at most {self.config.max_inflight_per_client}",
                        msg.req_id)
                session.inflight += 1
                task = self.loop.create_task(
                    self._run_async(session, op, msg, PhaseClock(t_recv)))
                self._tasks.add(task)
                self._task_requests[task] = (identity, op, msg.req_id)
                task.add_done_callback(self._task_done)
                return
        except ProtocolError as e:
            self.stats.count_request(op, e.code.value)
            log.info("refused %s from %s: %s: %s", op, session.client_name or "client",
                     e.code.value, e.message)
            self._send(identity, error_reply(e))
            return
        except Exception:
            log.exception("internal error handling %s", op)
            self.stats.count_request(op, ErrorCode.INTERNAL.value)
            self._send(identity, error_reply(ProtocolError(
                ErrorCode.INTERNAL, "internal server error (logged)", 0)))
            return
        self.stats.count_request(op, "ok")
        self._send(identity, encode(reply))

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._task_requests.pop(task, None)

    async def _run_async(self, session: Session, op: str, msg: Any,
                         clock: PhaseClock) -> None:
        ok = False
        try:
            reply = await getattr(self.handlers, _ASYNC_HANDLERS[type(msg)])(session, msg,
                                                                            clock)
            payload = encode(reply)
            self.stats.count_request(op, "ok")
            ok = True
        except ProtocolError as e:
            self.stats.count_request(op, e.code.value)
            log.info("refused %s from %s: %s: %s", op, session.client_name or "client",
                     e.code.value, e.message)
            payload = error_reply(e)
        except Exception:
            log.exception("internal error handling %s", op)
            self.stats.count_request(op, ErrorCode.INTERNAL.value)
            payload = error_reply(ProtocolError(ErrorCode.INTERNAL,
                                                "internal server error (logged)", msg.req_id))
        finally:
            session.inflight -= 1
        task = asyncio.current_task()
        if task is not None and task in self._answered:  # answered at the drain timeout
            return
        self._send(session.identity, payload)
        if ok:  # refusals are cheap and would skew the phase means
            clock.mark("finish")
            self.stats.observe_phases(op, clock)
        self._after_io()

    # -- reporting ----------------------------------------------------------------------

    def report(self) -> StatsReport:
        """The ``stats`` reply (see :mod:`lmc_server.server.report`)."""
        return build_report(self.config, self.engine.name, self.index, self.sessions,
                            self.stats, self.clock() - self.started_at_s, self.l2)

    # -- shutdown -----------------------------------------------------------------------

    def handle_exit(self) -> None:
        if not self.should_exit:
            log.info("shutdown requested")
        self.should_exit = True
        if self._exit_event is not None:
            self._exit_event.set()

    def handle_hup(self) -> None:
        """SIGHUP: reopen log files (after rotation) and log where the server stands."""
        files = reopen_logs()
        log.info("SIGHUP: %s; %s", f"reopened {', '.join(files)}" if files
                 else "logging to stderr, nothing to reopen",
                 self._status_line() if self.started else "starting")

    def _install_signal_handlers(self) -> None:
        handlers = {signal.SIGINT: self.handle_exit, signal.SIGTERM: self.handle_exit,
                    signal.SIGHUP: self.handle_hup}
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

    async def shutdown(self) -> None:
        """Stop taking work, let copies finish, answer the rest, release everything."""
        self.draining = True
        self.notifier.stopping(f"draining {len(self._tasks)} in-flight requests")
        for cb in self.on_shutdown:
            cb(self)
        if self._tasks:
            log.info("draining %d in-flight requests (up to %.0f s)", len(self._tasks),
                     self.config.drain_timeout_s)
            _, pending = await asyncio.wait(set(self._tasks),
                                            timeout=self.config.drain_timeout_s)
            if pending:
                self._answer_unfinished(pending)
                await asyncio.wait(pending)
        self._drain()  # answer what is still queued with shutting_down
        st = self.index.stats
        log.info("served %d requests; %d of %d looked-up chunks hit; %d objects stored, "
                 "%d retrieved, %d evicted", sum(dict(self.stats.requests).values()),
                 st.hit_chunks, st.lookup_chunks, st.stored_objects, st.retrieved_objects,
                 st.evictions)
        await self._close_resources()
        log.info("shutdown complete")

    def _answer_unfinished(self, pending: set[asyncio.Task[None]]) -> None:
        """At the drain timeout: answer stores now, wait for retrieves (module docstring).

        Copies cannot be interrupted (a running DMA or memcpy); a store's reply only
        says its chunks were not stored, which is true once nothing is served anymore.
        """
        waiting = 0
        for task in pending:
            info = self._task_requests.get(task)
            if info is None:
                continue
            identity, op, req_id = info
            if op != "store":
                waiting += 1
                continue
            self._answered.add(task)
            self.stats.count_request(op, ErrorCode.SHUTTING_DOWN.value)
            self._send(identity, error_reply(ProtocolError(
                ErrorCode.SHUTTING_DOWN, f"server shut down before this store finished "
                f"(drain timeout {self.config.drain_timeout_s:g} s); nothing was stored",
                req_id)))
        log.warning("drain timeout: %d stores answered shutting_down, waiting for %d "
                    "retrieves still copying into engine memory", len(self._answered), waiting)

    async def _close_resources(self) -> None:
        if self.l2 is not None:  # before the pool goes: its threads read and fill slots
            await self.l2.stop()
        if self._housekeeping_handle is not None:
            self._housekeeping_handle.cancel()
        if self._heartbeat_handle is not None:
            self._heartbeat_handle.cancel()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        sock = getattr(self, "sock", None)
        if sock is not None and not sock.closed:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self._fd)
                self.loop.remove_reader(self._monitor_fd)
            with contextlib.suppress(Exception):
                sock.disable_monitor()
                self.monitor.close(linger=0)
            sock.close(linger=0)
        for session in self.sessions.sessions():
            self.sessions.drop(session)
        pool = getattr(self, "host_pool", None)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        elif pool is not None:
            pool.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.term()
        self.notifier.close()


def _describe(cfg: Config) -> str:
    """Every effective setting, ``name=value``, for the startup log line."""
    values = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    values["l1_size_bytes"] = cfg.l1_size_bytes
    values["l1_size_gb"] = cfg.l1_size_bytes / (1 << 30)  # the size used, not 0 (default)
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                    for k, v in values.items())
