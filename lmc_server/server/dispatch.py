"""Request dispatch: one message's frames in, one reply out.

:meth:`Dispatcher.handle` is what the router calls for each message. It finds the peer's
session, enforces what holds for every request (hello first, nothing new while
draining, the in-flight limit), decodes, and either runs a control handler to
completion and sends its reply, or starts a store or retrieve whose reply is sent when
its copy is done: neither has a task of its own (its end is one callback on the loop,
or, when the engine copied inline, comes before the start returns: answered inside
the same drain, with no loop iteration in between; a store that must wait for another
writer's chunks waits in a task). Every request gets exactly one reply: a result, or an
``Error`` for a :class:`ProtocolError` (a refusal) or a bug (``internal``, logged); the
only exception is a peer that keeps talking without hello, which is ignored after
:data:`PRE_HELLO_MESSAGES` messages (no amplification).

The stores and retrieves still copying are tracked here (a future each, done when it is
answered), with who to answer for each, so that a drain that times out can answer the
stores itself (:meth:`answer_unfinished`) and the request's own reply is then
suppressed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import MethodType
from typing import Any

import zmq

from lmc_server.config import Config
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_request, encode, error_reply
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.protocol.stats import StatsReport
from lmc_server.server.data_path import DataRequest
from lmc_server.server.handlers import Handlers
from lmc_server.server.refusal_log import RefusalLog
from lmc_server.server.router import Router
from lmc_server.server.sessions import GREETED, IGNORED, Session, SessionEvent, SessionTable
from lmc_server.server.stats import PhaseClock, ServerStats

log = logging.getLogger(__name__)

#: Messages a peer may send before hello; past that it is ignored (no amplification).
PRE_HELLO_MESSAGES = 16

#: The dispatch table of the requests answered on the loop at once: message type -> its
#: :class:`Handlers` method, the one named by the message's tag (its wire name, also the
#: ``op`` label of the request metrics; ``tests/server/test_dispatch_table.py``). Bound to the
#: server's handlers once, in the :class:`Dispatcher`'s constructor: a request costs one
#: dict lookup and the handler's call. ``stats`` is the dispatcher's own (the report).
CONTROL_HANDLERS: dict[type, Callable[[Handlers, Session, Any], m.Reply]] = {
    m.Hello: Handlers.hello,
    m.Register: Handlers.register,
    m.Unregister: Handlers.unregister,
    m.Lookup: Handlers.lookup,
    m.LookupBatch: Handlers.lookup_batch,
    m.Release: Handlers.release,
    m.Ping: Handlers.ping,
    m.Clear: Handlers.clear,
    m.Probe: Handlers.probe,
}
SYNC_REQUESTS: tuple[type, ...] = tuple(CONTROL_HANDLERS)
#: Requests that copy: checked at once (:meth:`Handlers.data_request`), then started.
DATA_REQUESTS: tuple[type, ...] = (m.Store, m.Retrieve)


class _Pending:
    """Who to answer for one store or retrieve still copying, and whether the drain
    timeout answered it already (its own reply is then suppressed)."""

    __slots__ = ("identity", "op", "req_id", "answered")

    def __init__(self, identity: bytes, op: str, req_id: int) -> None:
        self.identity = identity
        self.op = op
        self.req_id = req_id
        self.answered = False


def tag_of(cls: type) -> str:
    """A message type's tag: its name on the wire, in handlers and in metrics."""
    return str(cls.__struct_config__.tag)  # type: ignore[attr-defined]


class Dispatcher:
    """Turns frames into handler calls and replies; tracks the copying requests.

    Replies go out through ``router`` (``send``; ``after_io`` after a send outside its
    drain; ``attribute`` tells which connection a new peer's message came over), which
    hands this dispatcher its messages once opened (``router.open(dispatcher.handle)``);
    ``report`` builds the ``stats`` reply. ``draining`` set: every new request is
    answered ``shutting_down``.
    """

    def __init__(
        self,
        config: Config,
        loop: asyncio.AbstractEventLoop,
        handlers: Handlers,
        router: Router,
        sessions: SessionTable,
        stats: ServerStats,
        clock: Callable[[], float],
        report: Callable[[], StatsReport],
    ) -> None:
        self.config = config
        self.loop = loop
        self.handlers = handlers
        self.sessions = sessions
        self.stats = stats
        self.clock = clock
        self.report = report
        self.draining = False
        #: message type -> bound handler (:data:`CONTROL_HANDLERS`, and ``stats``)
        self._sync: dict[type, Callable[[Session, Any], m.Reply]] = {
            cls: MethodType(fn, handlers) for cls, fn in CONTROL_HANDLERS.items()
        }
        self._sync[m.Stats] = self._stats
        self._ops: dict[type, str] = {
            cls: tag_of(cls) for cls in (*SYNC_REQUESTS, *DATA_REQUESTS, m.Stats)
        }
        self._limits = handlers.limits
        self._data_request = handlers.data_request
        self._start_store = handlers.start_store
        self._index = handlers.index
        self._start_retrieve = handlers.start_retrieve
        self._send = router.send
        self._after_io = router.after_io
        #: with KV events, a store answered inside a drain ends it (see Router.end_drain)
        self._end_drain = router.end_drain if handlers.events is not None else None
        self._attribute = router.attribute
        self.refusals = RefusalLog(clock)
        #: Stores and retrieves not answered yet: a future each, done when it is.
        self.tasks: set[asyncio.Future[None]] = set()
        #: Who to answer for each of them (and whether the drain timeout answered it
        #: ``shutting_down`` already: no second reply).
        self._task_requests: dict[asyncio.Future[None], _Pending] = {}

    def handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return
        t_recv = time.perf_counter()
        identity = frames[0].bytes
        payload = [f.bytes for f in frames[1:]]
        session = self.sessions.get_or_create(identity, self.clock())
        if session.conn is None:
            session.conn = self._attribute(identity, frames[0])
        op = "invalid"
        msg: Any = None
        try:
            state = session.state
            if state is not GREETED:
                if state is IGNORED:
                    return
                session.pre_hello += 1
                if session.pre_hello > PRE_HELLO_MESSAGES:
                    session.move(SessionEvent.SILENT_PAST_LIMIT)
                    log.warning(
                        "peer %s sent %d messages without hello: ignoring it",
                        identity.hex()[:8],
                        PRE_HELLO_MESSAGES,
                    )
                    return
            msg = decode_request(payload, self._limits)
            op = self._ops[type(msg)]
            if state is not GREETED and not isinstance(msg, m.Hello | m.Ping):
                raise ProtocolError(ErrorCode.HANDSHAKE, "send hello first", msg.req_id)
            if self.draining:
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "server is shutting down", msg.req_id)
            if (handler := self._sync.get(type(msg))) is not None:
                reply = handler(session, msg)
            else:
                clock = PhaseClock(t_recv)
                req = self._data_request(session, msg)  # refusals: not "busy"
                clock.mark("prepare")
                if not isinstance(msg, m.Retrieve) and not self._index.any_slab_ready:
                    # a server just started: its pool is prepared slab by slab, and a
                    # store that came before the first slab has nowhere to go. "busy"
                    # says "ask again": the connector's link retries it (a failed
                    # store would only have lost the chunks, never served wrong ones)
                    raise ProtocolError(
                        ErrorCode.BUSY, "the L1 pool is being prepared: no slab ready", msg.req_id
                    )
                if session.inflight >= self.config.max_inflight_per_client:
                    raise ProtocolError(
                        ErrorCode.BUSY,
                        f"{session.inflight} requests in flight on this "
                        f"connection; at most {self.config.max_inflight_per_client}",
                        msg.req_id,
                    )
                session.inflight += 1
                start = self._start_retrieve if isinstance(msg, m.Retrieve) else self._start_store
                self._data(session, op, req, clock, start)
                return
        except ProtocolError as e:
            self._send(identity, self._refused(session, op, e))
            return
        except Exception:  # a bug: answered under the request's id when it was decoded
            self._send(identity, self._internal_error(op, getattr(msg, "req_id", 0)))
            return
        self.stats.count_request(op, "ok")
        self._send(identity, encode(reply))

    def _stats(self, session: Session, msg: m.Stats) -> m.StatsResult:
        return m.StatsResult(req_id=msg.req_id, stats=self.report())

    def _refused(self, session: Session, op: str, e: ProtocolError) -> bytes:
        """Count and log a refusal (a few lines per client and minute, the rest
        summarized: :mod:`~lmc_server.server.refusal_log`); the ``error`` reply."""
        self.stats.count_request(op, e.code.value)
        self.refusals.refused(session, op, e)
        return error_reply(e)

    def _internal_error(self, op: str, req_id: int, error: BaseException | None = None) -> bytes:
        """Count and log a bug (``error``, or the one being handled); the ``internal``
        reply."""
        log.error("internal error handling %s", op, exc_info=error or True)
        self.stats.count_request(op, ErrorCode.INTERNAL.value)
        return error_reply(
            ProtocolError(ErrorCode.INTERNAL, "internal server error (logged)", req_id)
        )

    def _track(self, fut: asyncio.Future[None], pending: _Pending) -> None:
        self.tasks.add(fut)
        self._task_requests[fut] = pending
        fut.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[None]) -> None:
        self.tasks.discard(task)
        self._task_requests.pop(task, None)

    def _data(
        self,
        session: Session,
        op: str,
        req: DataRequest,
        clock: PhaseClock,
        start: Callable[..., None],
    ) -> None:
        """Start a store or retrieve; its answer goes out from the callback that ends it.

        A request the handler finished before ``start`` returned (its copy completed
        inline) is answered from inside this call and never tracked; one still copying
        (or a store waiting for another writer) is tracked by a future, done when it is
        answered, so that the drain waits for it and, at its timeout, answers the stores
        itself (the request's own reply is then suppressed)."""
        done: asyncio.Future[None] | None = None
        pending: _Pending | None = None
        finished = starting = False

        def finish(reply: m.Reply | None, error: BaseException | None) -> None:
            nonlocal finished
            if finished:
                log.error("a %s finished twice (ignored)", op)
                return
            finished = True
            session.inflight -= 1
            ok = False
            if error is None:
                try:
                    assert reply is not None
                    payload = encode(reply)
                    self.stats.count_request(op, "ok")
                    ok = True
                except Exception as e:
                    payload = self._internal_error(op, req.msg.req_id, e)
            elif isinstance(error, ProtocolError):
                payload = self._refused(session, op, error)
            else:
                payload = self._internal_error(op, req.msg.req_id, error)
            if done is not None:
                done.set_result(None)
            if pending is not None and pending.answered:  # answered at the drain timeout
                return
            self._send(session.identity, payload)
            if ok:  # refusals are cheap and would skew the phase means
                clock.mark("finish")
                self.stats.observe_phases(op, clock)
            if not starting:  # inside a drain the drain itself looks for more
                self._after_io()
            elif self._end_drain is not None:
                self._end_drain()

        starting = True
        try:
            start(session, req, clock, finish)
        except Exception as e:  # a refusal or a bug: answered now unless it was already
            if finished:
                log.exception("internal error after a %s was answered", op)
            else:
                finish(None, e)
        starting = False
        if not finished:
            pending = _Pending(session.identity, op, req.msg.req_id)
            done = self.loop.create_future()
            self._track(done, pending)

    def answer_unfinished(self, pending: set[asyncio.Future[None]]) -> None:
        """At the drain timeout: answer stores now, wait for retrieves.

        Copies cannot be interrupted (a running DMA or memcpy); a store's reply only
        says its chunks were not stored, which is true once nothing is served anymore.
        A retrieve writes into the engine's memory, so it is answered by its own task
        when its copy has stopped: a reply before that would let the engine reuse
        blocks still being written.
        """
        waiting = answered = 0
        for task in pending:
            info = self._task_requests.get(task)
            if info is None or info.answered:
                continue
            if info.op != "store":
                waiting += 1
                continue
            info.answered = True
            answered += 1
            req_id = info.req_id
            self.stats.count_request(info.op, ErrorCode.SHUTTING_DOWN.value)
            self._send(
                info.identity,
                error_reply(
                    ProtocolError(
                        ErrorCode.SHUTTING_DOWN,
                        f"server shut down before this store finished "
                        f"(drain timeout {self.config.drain_timeout_s:g} s); nothing was stored",
                        req_id,
                    )
                ),
            )
        log.warning(
            "drain timeout: %d stores answered shutting_down, waiting for %d "
            "retrieves still copying into engine memory",
            answered,
            waiting,
        )
