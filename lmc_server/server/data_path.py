"""The data path's handlers: store and retrieve, typed request in, typed reply out.

A store or retrieve is parsed and checked once, into a :class:`DataRequest`, by
:meth:`DataPath.data_request` (the dispatcher calls it before the request gets a task),
and copied in one submission. The bookkeeping runs on the loop, the copy is handed to
the engine (``submit``: planned and launched here, completed on the engine's threads, one
wake-up back through a :class:`Completion`), and the bookkeeping finishes on the loop
again, so the index is only ever touched from one thread. Slots a copy may still write
are freed or unpinned only after that copy reported, even when a bug raises in between.

:class:`DataPath` is built complete by its own constructor (everything it reads is set
there: the tiers below L1 and the KV-event publisher, ``None`` when not configured, and
``before_commit``); :class:`~lmc_server.server.handlers.Handlers` extends it with the
control requests, so that the dispatcher finds every request's handler on one object
(docs/architecture.md, "The server", says why this one stays a base class).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lmc_server.cache.index import L1Index, RetrieveTicket, StoreTicket
from lmc_server.cache.layout import RunCopy
from lmc_server.cache.view import CacheView
from lmc_server.config import Config
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import Limits, check_store_events, chunk_count, prefix_ends
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.server.completion import Completion
from lmc_server.server.resolved import Resolved, ResolvedRetrieves
from lmc_server.server.sessions import OPEN, RegisteredCache, Session, SessionTable
from lmc_server.server.settle import CommitWatch
from lmc_server.server.stats import PhaseClock, ServerStats
from lmc_server.server.validate import CheckedIds
from lmc_server.transfer.base import TransferEngine, TransferError

if TYPE_CHECKING:
    from lmc_server.server.events.publisher import KvEventPublisher
    from lmc_server.tiers.chain import TierChain

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DataRequest:
    """A store or retrieve checked against its registration: what the handler needs,
    resolved once (the registration, one block-id array per group, the chunk keys; a
    retrieve's prefix ends, a store's engine hashes per chunk for its KV events)."""

    msg: m.Store | m.Retrieve
    reg: RegisteredCache
    ids: dict[int, np.ndarray]
    keys: list[bytes]
    ends: list[int]
    events_per_chunk: int
    #: a retrieve's identity (:mod:`lmc_server.server.resolved`), the index's plan key
    plan_key: tuple[object, ...] | None = None


def _nothing() -> None:
    pass


class DataPath:
    """Store and retrieve (and the one check of their requests).

    ``before_commit`` is called after a store's copy returns and before it commits:
    the server handles its queued connection events there (the router's monitor, never
    requests: a store may be deciding inside the drain that read it), so a writer that
    died during the copy is seen (its registration closes) and its object is aborted,
    not committed.
    ``l2`` (``--disk-dir``, ``--l2``) is told of every store commit and of every lookup
    that misses L1 (:mod:`lmc_server.tiers.chain`); ``events`` (``--kv-events-endpoint``)
    publishes what commits.
    """

    def __init__(
        self,
        config: Config,
        index: L1Index,
        engine: TransferEngine,
        sessions: SessionTable,
        stats: ServerStats,
        clock: Callable[[], float] = time.monotonic,
        *,
        l2: TierChain | None = None,
        events: KvEventPublisher | None = None,
        before_commit: Callable[[], None] = _nothing,
    ) -> None:
        self.config = config
        self.index = index
        self.engine = engine
        self.sessions = sessions
        self.stats = stats
        self.clock = clock
        self.limits = Limits(max_frame_bytes=config.max_frame_bytes)
        self.l2 = l2
        self.events = events
        self.before_commit = before_commit
        #: Stores that found their keys being written by another store wait on this.
        self.commits = CommitWatch(index, clock)
        #: The block ids of recent data requests, checked once (identical requests of
        #: tensor-parallel ranks reuse them).
        self.checked_ids = CheckedIds()
        #: Recent retrieves resolved once (block ids, keys, prefix ends), for the
        #: identical ones of tensor-parallel ranks.
        self.resolved = ResolvedRetrieves()
        #: Stores waiting for another store's chunks (held here until they answer).
        self._settling: set[asyncio.Task[None]] = set()

    def _registration(self, session: Session, msg: Any) -> RegisteredCache:
        """The sender's registration the request names (refused: unknown)."""
        reg = self.sessions.find(session, msg.registration_id)
        if reg is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_REGISTRATION,
                "no such registration on this connection",
                msg.req_id,
            )
        return reg

    def _keys(self, view: CacheView, msg: Any) -> list[bytes]:
        """The chunk keys of a request's digests (and salt); a bad salt is refused."""
        try:
            return self.index.keys(view, msg.digests, msg.salt)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e), msg.req_id) from None

    def data_request(self, session: Session, msg: m.Store | m.Retrieve) -> DataRequest:
        """Resolve and check a store or retrieve once (a refusal raises
        :class:`ProtocolError` before anything is reserved or copied)."""
        reg = self._registration(session, msg)
        if reg.lookup_only:
            raise ProtocolError(
                ErrorCode.LOOKUP_ONLY, "this registration has no buffers (lookup-only)", msg.req_id
            )
        if isinstance(msg, m.Retrieve):
            key = ResolvedRetrieves.key(reg, msg)
            known = self.resolved.get(key, reg)
            if known is None:
                n = chunk_count(msg.digests, self.limits, msg.req_id)
                ids = self.checked_ids.check(reg.groups, reg.blocks_per_chunk, msg, n)
                keys = self._keys(reg.view, msg)
                ends = prefix_ends(msg.prefix_ends, n, msg.req_id)
                known = Resolved(reg.view.layout, ids, keys, ends, key)
                self.resolved.put(known)  # resolved without a refusal
            return DataRequest(msg, reg, known.ids, known.keys, known.ends, 0, known.key)
        n = chunk_count(msg.digests, self.limits, msg.req_id)
        ids = self.checked_ids.check(reg.groups, reg.blocks_per_chunk, msg, n)
        keys = self._keys(reg.view, msg)
        per = (
            check_store_events(msg.events, n, self.config.chunk_size, msg.req_id)
            if msg.events is not None
            else 0
        )
        return DataRequest(msg, reg, ids, keys, [], per)

    def _start_copy(
        self,
        reg: RegisteredCache,
        copies: list[RunCopy],
        to_pool: bool,
        clock: PhaseClock,
        bugs: list[BaseException],
        copied: Callable[[Completion], None],
    ) -> None:
        """Hand a request's copies to the engine; ``copied`` runs once: here if the
        engine copied inline (no loop iteration in between), else on the loop when the
        copy reports. A refusal is reported as the copy's error, and a bug goes to
        ``bugs`` after its part reported, so ``copied`` still runs (it frees or unpins
        the slots, after anything the copy may still write).

        The registration may have closed since the request was checked: its session
        dropped while the request waited to run (seen after a SIGSTOP/SIGCONT of the
        server, when the store and the heartbeat's disconnect arrive in one loop
        iteration), and an idle registration unmaps at once, so the copy is refused,
        not started."""
        completion = Completion(asyncio.get_running_loop(), then=lambda: copied(completion))
        reg.begin_op()
        done = completion.part()
        try:
            if reg.mapping is None or reg.state is not OPEN:
                raise TransferError("registration closed before its copy started")
            self.engine.submit(reg.mapping, copies, to_pool, done)
        except TransferError as e:
            done(str(e) or "copy failed")
        except Exception as e:  # a bug: the part still reports, so the request can finish
            done("copy not started: internal error")
            bugs.append(e)
        except BaseException:
            done("copy not started: internal error")
            raise
        else:
            clock.mark("submit")
        if completion.seal():  # the copy completed inline: decided now
            copied(completion)

    def start_store(
        self,
        session: Session,
        req: DataRequest,
        clock: PhaseClock,
        finish: Callable[[m.StoreResult | None, BaseException | None], None],
    ) -> None:
        """Reserve, copy, commit (last chunk first, see :mod:`lmc_server.cache`), with no
        task of its own: ``finish(reply, None)`` on the loop once the store is decided,
        or ``finish(None, error)`` for a bug; ``finish`` is called once. A refusal
        (``busy`` while the pool is being prepared) raises before anything was copied.

        A store whose copy the engine completed before ``submit`` returned (the cpu
        engine's small copies) and whose chunks no other store is writing is finished
        before this returns: no task, no loop iteration. Otherwise ``finish`` comes from
        the engine's completion callback on the loop, or from the wait for the other
        writers (:meth:`_settle_then`). Either way the invariants are the same: the
        objects become visible only after the copy reported success, ``before_commit``
        runs between the copy and the commit (a writer that died during the copy is
        aborted, not committed), and slots a copy may still write are freed only once
        it has reported."""
        clock.mark("queue")
        msg, reg, keys, per = req.msg, req.reg, req.keys, req.events_per_chunk
        assert isinstance(msg, m.Store)
        ticket = self.index.reserve_store(reg.view, keys, req.ids)
        clock.mark("prepare")
        if self.index.awaits_a_slab(reg.view, ticket):
            # a server that just started: slabs are handed out as they are prepared,
            # and a partition of this view has none yet (with separate object groups
            # one group may be placed while another is not). Nothing was copied: the
            # reservation is freed and "busy" says "ask again" (the connector's link
            # does), instead of a chunk failed for want of a slab that is coming.
            self.index.abort_store(ticket)
            raise ProtocolError(
                ErrorCode.BUSY,
                "the L1 pool is being prepared: no room ready for this store yet",
                msg.req_id,
            )
        if not ticket.copies:  # every chunk already stored or being stored
            self._commit(ticket, keys, msg, per)
            self._settle_then(reg, keys, ticket, msg, finish)
            return
        bugs: list[BaseException] = []

        def copied(completion: Completion) -> None:
            try:
                clock.mark_at("copy", completion.done_at)
                clock.mark("hop_out")
                err = next((e for e in completion.errors if e), "")
                self.before_commit()
                if err or bugs or reg.state is not OPEN:
                    self.index.abort_store(ticket)
                    if not bugs:
                        log.warning(
                            "store by %s failed: %s",
                            reg.registration_id.hex()[:8],
                            err or "registration closed during the copy",
                        )
                else:
                    self._commit(ticket, keys, msg, per)
                    self.stats.observe_transfer(
                        "store", ticket.nbytes, completion.done_at - completion.started_at
                    )
                    if self.l2 is not None:
                        self.l2.on_commit(reg.namespace, ticket)
            except Exception as e:  # a bug: reported to the caller, like one of submit
                bugs.append(e)
            finally:
                reg.end_op()
                self.commits.changed()
            if bugs:
                finish(None, bugs[0])
            else:
                self._settle_then(reg, keys, ticket, msg, finish)

        self._start_copy(reg, ticket.copies, True, clock, bugs, copied)

    def _settle_then(
        self,
        reg: RegisteredCache,
        keys: list[bytes],
        ticket: StoreTicket,
        msg: m.Store,
        finish: Callable[[m.StoreResult | None, BaseException | None], None],
    ) -> None:
        """Answer a decided store: at once, unless some of its chunks are being written
        by another store (``IN_PROGRESS``), whose outcome a task waits for first
        (:class:`~lmc_server.server.settle.CommitWatch`)."""
        statuses = list(ticket.statuses)
        if not ticket.others:
            finish(_stored(msg, statuses), None)
            return

        async def settle() -> None:
            try:
                await self.commits.settle(reg.view, keys, statuses)
            except Exception as e:  # a bug: answered as one
                finish(None, e)
            else:
                finish(_stored(msg, statuses), None)

        task = asyncio.get_running_loop().create_task(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def store(self, session: Session, req: DataRequest, clock: PhaseClock) -> m.StoreResult:
        """:meth:`start_store`, awaited (for callers that run it as a coroutine)."""
        fut: asyncio.Future[m.StoreResult] = asyncio.get_running_loop().create_future()
        self.start_store(session, req, clock, _resolver(fut))
        return await fut

    def _commit(self, ticket: StoreTicket, keys: list[bytes], msg: m.Store, per: int) -> None:
        """Commit a store's ticket; the event publisher sees its objects with the
        store's event fields (``per`` engine hashes per chunk)."""
        if self.events is None:
            self.index.commit_store(ticket)
            return
        with self.events.staged(keys, msg.events, per, salted=bool(msg.salt)):
            self.index.commit_store(ticket)

    def start_retrieve(
        self,
        session: Session,
        req: DataRequest,
        clock: PhaseClock,
        finish: Callable[[m.RetrieveResult | None, BaseException | None], None],
    ) -> None:
        """Pin, copy, unpin, with no task of its own: ``finish(reply, None)`` on the loop
        once the copy is done, or ``finish(None, error)`` for a bug, whose pinned slots
        are unpinned once nothing can read them any more. ``finish`` is called once; a
        retrieve with nothing to copy is finished before this returns."""
        clock.mark("queue")
        msg, reg = req.msg, req.reg
        assert isinstance(msg, m.Retrieve)
        ticket = self.index.pin_retrieve(reg.view, req.keys, req.ids, req.ends, req.plan_key)
        clock.mark("prepare")
        if not ticket.copies:
            self.index.unpin_retrieve(ticket, True)
            finish(_retrieved(msg, ticket), None)
            return
        bugs: list[BaseException] = []

        def copied(completion: Completion) -> None:
            try:
                clock.mark_at("copy", completion.done_at)
                clock.mark("hop_out")
                err = next((e for e in completion.errors if e), "")
                if err and not bugs:
                    log.warning("retrieve by %s failed: %s", reg.registration_id.hex()[:8], err)
                ok = not err and not bugs
                self.index.unpin_retrieve(ticket, ok)
                if ok:
                    self.stats.observe_transfer(
                        "retrieve", ticket.nbytes, completion.done_at - completion.started_at
                    )
            except Exception as e:  # a bug: reported to the caller, like one of submit
                bugs.append(e)
            finally:
                reg.end_op()
            if bugs:
                finish(None, bugs[0])
            else:
                finish(_retrieved(msg, ticket), None)

        self._start_copy(reg, ticket.copies, False, clock, bugs, copied)

    async def retrieve(
        self, session: Session, req: DataRequest, clock: PhaseClock
    ) -> m.RetrieveResult:
        """:meth:`start_retrieve`, awaited (for callers that run it as a coroutine)."""
        fut: asyncio.Future[m.RetrieveResult] = asyncio.get_running_loop().create_future()
        self.start_retrieve(session, req, clock, _resolver(fut))
        return await fut


def _resolver(fut: asyncio.Future[Any]) -> Callable[[Any, BaseException | None], None]:
    """A ``finish`` callback that resolves ``fut`` with the reply or the error."""

    def finish(reply: Any, error: BaseException | None) -> None:
        if error is not None:
            fut.set_exception(error)
        else:
            assert reply is not None
            fut.set_result(reply)

    return finish


def _stored(msg: m.Store, statuses: list[np.ndarray]) -> m.StoreResult:
    return m.StoreResult(req_id=msg.req_id, statuses=[s.tobytes() for s in statuses])


def _retrieved(msg: m.Retrieve, ticket: RetrieveTicket) -> m.RetrieveResult:
    return m.RetrieveResult(req_id=msg.req_id, statuses=[s.tobytes() for s in ticket.statuses])
