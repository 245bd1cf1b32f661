"""Request handlers: one method per message type, typed request in, typed reply out.

Control requests (hello, register, lookup, lookup_batch, release, ping, clear, probe)
run to completion on the event-loop thread, here. Store and retrieve are
:mod:`lmc_server.server.data_path`'s (the class this one extends; its constructor
builds everything both read). The dispatcher's table maps each message type to its
method here (:data:`~lmc_server.server.dispatch.CONTROL_HANDLERS`).

Every refusal raises :class:`ProtocolError` before anything is copied; the server
turns it into an ``Error`` reply and goes on serving.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from lmc_server import PROTOCOL_VERSION, __version__
from lmc_server.cache.geometry import ArchError, GeometryError, blocks_per_chunk, check_groups
from lmc_server.cache.index import L1Index
from lmc_server.cache.layout import build_layout
from lmc_server.cache.view import CacheView
from lmc_server.config import Config
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import chunk_count, prefix_ends
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.server.data_path import DataPath
from lmc_server.server.sessions import RegisteredCache, Session, SessionEvent, SessionTable
from lmc_server.server.stats import ServerStats
from lmc_server.transfer.base import TransferEngine, TransferError

if TYPE_CHECKING:
    from lmc_server.server.events.publisher import KvEventPublisher
    from lmc_server.tiers.chain import TierChain

log = logging.getLogger(__name__)


_NAME = re.compile(r"^[A-Za-z0-9_.:/@+\-]{1,256}$")
_ARCH = re.compile(r"^[a-z0-9_]{1,32}$")


def namespace_of(msg: m.Register) -> str:
    """Everything that must match for bytes to be reusable (salt aside)."""
    rank = "replicated" if msg.replicated else str(msg.rank)
    return (
        f"model={msg.model};kv_dtype={msg.kv_dtype};arch={msg.arch};"
        f"world={msg.world_size};rank={rank}"
    )


class Handlers(DataPath):
    """Owns the request semantics; the :class:`Server` owns sockets and lifecycle. The
    store and retrieve handlers are :class:`~lmc_server.server.data_path.DataPath`'s,
    and so are the constructor's arguments (the tiers, the publisher, ``before_commit``
    included: the server builds them first)."""

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
        before_commit: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(
            config,
            index,
            engine,
            sessions,
            stats,
            clock,
            l2=l2,
            events=events,
            before_commit=before_commit,
        )
        #: The latest view of every namespace registered since start, for probes.
        self.views: dict[str, CacheView] = {}

    # -- control ----------------------------------------------------------------------

    def hello(self, session: Session, msg: m.Hello) -> m.Welcome:
        if msg.protocol_version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION,
                f"protocol version {msg.protocol_version} not supported; "
                f"this server speaks {PROTOCOL_VERSION}",
                msg.req_id,
            )
        session.move(SessionEvent.HELLO)
        session.client_name = msg.client_name[:128]
        return m.Welcome(
            req_id=msg.req_id,
            protocol_version=PROTOCOL_VERSION,
            server_version=__version__,
            chunk_size=self.config.chunk_size,
            backend=self.engine.name,
            max_frame_bytes=self.limits.max_frame_bytes,
            max_chunks_per_request=self.limits.max_chunks_per_request,
            fd_socket=self.engine.fd_socket,
        )

    def register(self, session: Session, msg: m.Register) -> m.Registered:
        rid = msg.req_id
        if not _NAME.match(msg.model) or not _NAME.match(msg.kv_dtype):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                "model and kv_dtype must be 1-256 characters of [A-Za-z0-9_.:/@+-]",
                rid,
            )
        if not _ARCH.match(msg.arch):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"arch {msg.arch!r} must look like sm90", rid
            )
        if not 1 <= msg.world_size <= 1 << 16 or not 0 <= msg.rank < msg.world_size:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"rank {msg.rank} / world size {msg.world_size} invalid", rid
            )
        sizes = [b.size_bytes for b in msg.buffers] if msg.buffers else None
        try:
            check_groups(msg.groups, self.config.chunk_size, msg.arch, sizes)
        except ArchError as e:
            raise ProtocolError(ErrorCode.ARCH, str(e), rid) from None
        except GeometryError as e:
            raise ProtocolError(ErrorCode.GEOMETRY, str(e), rid) from None
        layout = build_layout(
            msg.groups, self.config.chunk_size, self.config.separate_object_groups
        )
        for og in layout.object_groups:
            if og.object_bytes > self.index.slab_bytes:
                raise ProtocolError(
                    ErrorCode.GEOMETRY,
                    f"object group {og.name!r}: one chunk is {og.object_bytes} bytes, more "
                    f"than a slab ({self.index.slab_bytes} bytes); start the server "
                    f"with a larger --slab-size-mb or a smaller --chunk-size",
                    rid,
                )
        mapping = None
        if msg.buffers:
            try:
                mapping = self.engine.open(msg.buffers)
            except TransferError as e:
                raise ProtocolError(ErrorCode.TRANSFER, str(e), rid) from None
            dev_arch = mapping.device.arch
            if dev_arch is not None and dev_arch != msg.arch:
                mapping.close()
                raise ProtocolError(
                    ErrorCode.ARCH,
                    f"registration says arch {msg.arch} but its buffers are "
                    f"on {mapping.device.description} ({dev_arch})",
                    rid,
                )
        namespace = namespace_of(msg)
        view = self.views[namespace] = self.index.view(namespace, layout)
        if self.events is not None:
            published = msg.replicated or msg.rank == 0
            for og_index in self.events.watch(view, namespace, msg.model, published):
                self.index.watch(view, og_index, self.events)
        bpc = [blocks_per_chunk(g, self.config.chunk_size) for g in msg.groups]
        reg = RegisteredCache(
            self.sessions.new_registration_id(),
            session,
            namespace,
            list(msg.groups),
            view,
            mapping,
            bpc,
        )
        self.sessions.add(reg)
        summary = ", ".join(f"{og.name}={og.object_bytes}B" for og in layout.object_groups)
        log.info(
            "registered %s for %s (%s): %d groups, %d buffers, objects per chunk: %s",
            reg.registration_id.hex()[:8],
            session.client_name or "client",
            namespace,
            len(msg.groups),
            len(msg.buffers),
            summary,
        )
        return m.Registered(
            req_id=rid,
            registration_id=reg.registration_id,
            namespace=namespace,
            chunk_size=self.config.chunk_size,
            lookup_only=mapping is None,
            object_groups=[
                m.ObjectGroupInfo(
                    name=og.name,
                    object_bytes=og.object_bytes,
                    groups=[s.group_name for s in og.sections],
                )
                for og in layout.object_groups
            ],
        )

    def unregister(self, session: Session, msg: m.Unregister) -> m.Unregistered:
        reg = self._registration(session, msg)
        self.sessions.remove(reg)
        log.info("unregistered %s", reg.registration_id.hex()[:8])
        return m.Unregistered(req_id=msg.req_id)

    def _lookup_prefix(
        self, reg: RegisteredCache, session: Session, keys: list[bytes], now_s: float, lease: bool
    ) -> tuple[int, int, int]:
        """One prefix looked up: its hit chunks, lease id (0: none) and the chunks asked
        of the lower tiers after an L1 miss."""
        hit, taken = self.index.lookup(
            reg.view, keys, session.sid, self.config.lease_ttl_s, now_s, take_lease=lease
        )
        pending = (
            self.l2.on_lookup(reg.view, reg.namespace, keys, hit)
            if self.l2 is not None and hit < len(keys)
            else 0
        )
        return hit, taken.lease_id if taken else 0, pending

    def lookup(self, session: Session, msg: m.Lookup) -> m.LookupResult:
        reg = self._registration(session, msg)
        chunk_count(msg.digests, self.limits, msg.req_id)
        keys = self._keys(reg.view, msg)
        hit, lease_id, pending = self._lookup_prefix(reg, session, keys, self.clock(), msg.lease)
        return m.LookupResult(
            req_id=msg.req_id,
            hit_chunks=hit,
            lease_id=lease_id,
            lease_ttl_s=self.config.lease_ttl_s if lease_id else 0.0,
            l2_pending_chunks=pending,
        )

    def lookup_batch(self, session: Session, msg: m.LookupBatch) -> m.LookupBatchResult:
        """Each prefix of the batch looked up as :meth:`lookup` does, with its own lease.
        Everything is checked (registration, chunk count, ``prefix_ends``, salt) before
        the first lease is taken, so a refused batch pins nothing."""
        reg = self._registration(session, msg)
        n = chunk_count(msg.digests, self.limits, msg.req_id)
        ends = prefix_ends(msg.prefix_ends, n, msg.req_id) if n or msg.prefix_ends else []
        keys = self._keys(reg.view, msg)
        now_s = self.clock()
        hits, lease_ids, pending = [], [], []
        lo = 0
        for hi in ends:
            part, lo = keys[lo:hi], hi
            hit, lease_id, asked = self._lookup_prefix(reg, session, part, now_s, msg.lease)
            hits.append(hit)
            lease_ids.append(lease_id)
            pending.append(asked)
        return m.LookupBatchResult(
            req_id=msg.req_id,
            hit_chunks=np.asarray(hits, dtype="<i4").tobytes(),
            lease_ids=np.asarray(lease_ids, dtype="<u8").tobytes(),
            lease_ttl_s=self.config.lease_ttl_s if any(lease_ids) else 0.0,
            l2_pending_chunks=np.asarray(pending, dtype="<i4").tobytes() if any(pending) else b"",
        )

    def probe(self, session: Session, msg: m.Probe) -> m.ProbeResult:
        """Hit chunks per prompt for a router (see ``m.Probe``): no lease, no touch."""
        n = chunk_count(msg.digests, self.limits, msg.req_id)
        ends = prefix_ends(msg.prefix_ends, n, msg.req_id) if n or msg.prefix_ends else []
        view = self.views.get(msg.namespace)
        hits = [0] * len(ends)
        if view is not None and ends:
            keys = self._keys(view, msg)
            hits = self.index.probe(view, keys, ends)
        return m.ProbeResult(
            req_id=msg.req_id,
            chunk_size=self.config.chunk_size,
            hit_chunks=np.asarray(hits, dtype="<i4").tobytes(),
        )

    def release(self, session: Session, msg: m.Release) -> m.Released:
        return m.Released(req_id=msg.req_id, released=self.index.release(msg.lease_id))

    def ping(self, session: Session, msg: m.Ping) -> m.Pong:
        return m.Pong(
            req_id=msg.req_id,
            server_version=__version__,
            ready=self.index.pool_usage().ready_slabs > 0,
        )

    def clear(self, session: Session, msg: m.Clear) -> m.Cleared:
        n = self.index.clear()
        log.info("clear: evicted %d objects", n)
        return m.Cleared(req_id=msg.req_id, evicted=n)

    # -- session end ------------------------------------------------------------------

    def drop_session(self, session: Session, reason: str) -> None:
        """Reclaim everything a session held: registrations, mappings, leases, writes.

        Stores still copying are not aborted here (their slots are being written by a
        worker thread); their registration is closing, so they abort when the copy
        returns, and the mapping is unmapped after the last copy.
        """
        regs = self.sessions.drop(session)
        leases = self.index.drop_owner(session.sid)
        log.info(
            "session %d (%s) dropped: %s; %d registrations, %d leases reclaimed",
            session.sid,
            session.client_name or "client",
            reason,
            len(regs),
            leases,
        )
