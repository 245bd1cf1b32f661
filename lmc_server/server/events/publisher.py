"""KV events for routers: the L1 tier's stores and removals in vLLM's wire format.

With ``--kv-events-endpoint`` the server publishes, on a ZeroMQ PUB socket of its own,
what a KV-aware router needs to send a request where its prefix is cached
(:mod:`lmc_server.protocol.kv_events` has the layout; docs/vllm.md says why the server
publishes itself rather than through vLLM's publisher):

* ``BlockStored`` when an object becomes visible (a store commits, an L2 fetch lands),
  ``BlockRemoved`` when it is evicted, moved with its slab or cleared, medium ``CPU``;
* ``AllBlocksCleared`` first, at start (the pool is empty), and on a model's topic when
  the first registration of that model arrives;
* one batch per topic per event-loop iteration, sequence numbers from 0 across topics,
  the last ``replay_batches`` kept for the replay socket (vLLM's ROUTER protocol).

What is published: objects of the object group a hit requires (full attention; the only
group of a window-only layout), of namespaces a scheduler looks up (rank 0, or
replicated KV), stored without a cache salt. The topic is ``topic_prefix + model``. A
store that carries the connector's ``events`` fields is published with the engine's
per-block hashes and tokens (routers hash tokens themselves); any other object with one
hash per chunk (the first 8 bytes of its digest) and no tokens. Every ``BlockRemoved``
names hashes an earlier ``BlockStored`` published.

Bounded: every send is non-blocking (a high-water mark and ``XPUB_NODROP``: a batch goes
to every subscriber or, while one's queue is full, to none, counted in
``dropped_batches`` and kept for replay); once sends have failed for longer than
``--heartbeat-timeout-s`` the PUB socket is re-created (``stall_resets``), so one stuck
subscriber cannot silence the stream for the others (docs/operations.md, "KV events").
The disk tier's objects are published by :mod:`lmc_server.server.events.tiers`, replays
served by :mod:`lmc_server.server.events.replay`; the settings are
:mod:`lmc_server.server.events.settings` (socket options and CURVE
:mod:`lmc_server.server.events.sockets`), the encoding of a commit's events and of a
run of removals :mod:`lmc_server.server.events.stage`. Loop thread only: the index calls
:class:`~lmc_server.cache.watch.SlotWatcher` inside its operations, which only appends;
encoding and sending happen in :meth:`KvEventPublisher.flush`, once per loop iteration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from lmc_server.cache.counters import KvEventCounters
from lmc_server.cache.keys import NS_BYTES
from lmc_server.cache.view import CacheView
from lmc_server.protocol import kv_events as ev
from lmc_server.protocol.messages import StoreEvents
from lmc_server.server.events.replay import ReplayBuffer
from lmc_server.server.events.settings import KvEventSettings, binds, needs_curve
from lmc_server.server.events.sockets import Curve, heartbeat
from lmc_server.server.events.stage import Removals, Stage
from lmc_server.server.events.tiers import DiskEvents
from lmc_server.server.security import bound_ipc_file, remove_ipc

if TYPE_CHECKING:
    from lmc_server.tiers.events import TierListeners

log = logging.getLogger(__name__)

#: The event-hash of an object stored without the connector's fields: the first bytes
#: of its digest, as a big-endian uint64 (routers reduce every hash to 64 bits).
_DIGEST_HASH = slice(NS_BYTES, NS_BYTES + 8)


class KvEventPublisher:
    """The PUB and replay sockets, the events of the current loop iteration, the replay
    buffer. ``wall_clock`` stamps batches (``ts``, seconds since the epoch, as vLLM)."""

    def __init__(
        self,
        settings: KvEventSettings,
        loop: asyncio.AbstractEventLoop,
        chunk_size: int,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.loop = loop
        self.chunk_size = chunk_size
        self.wall_clock = wall_clock
        self.stats = KvEventCounters()
        self._ctx = zmq.Context()
        self._curve = Curve(self._ctx, settings)
        self._pub: zmq.Socket[Any] | None = None
        self._live = False  # between open() and close()
        #: namespace key prefix -> topic, or None for a namespace that is not published.
        self._topics: dict[bytes, bytes | None] = {}
        self._models: set[bytes] = set()
        #: key of every object a subscriber was told of -> its event hashes (encoded
        #: msgpack uint64 elements), None when they derive from the digest.
        self._published: dict[bytes, bytes | None] = {}
        self._pending: dict[bytes, list[Any]] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._stage: Stage | None = None
        #: (namespace, layout fingerprint, key prefix) of every watched object group
        self._watched: list[tuple[str, bytes, bytes]] = []
        self.disk: DiskEvents | None = None
        self.next_seq = 0
        #: ``monotonic`` time of the first failed send since the last one that went out
        self._stalled_since: float | None = None
        self.replay = ReplayBuffer(settings.replay_batches, loop, self.stats)
        #: (path, inode) of the ipc:// socket files bound, removed at close
        self._ipc_files: list[tuple[str, int]] = []

    # -- lifecycle ----------------------------------------------------------------------

    def open(self) -> None:
        """Bind the sockets and publish ``AllBlocksCleared`` (the pool starts empty)."""
        s = self.settings
        try:
            self._pub = self._bind_pub()
            if s.replay_endpoint:
                rep = self._ctx.socket(zmq.ROUTER)
                try:
                    heartbeat(rep, s.heartbeat_timeout_s)
                    self._curve.secure(rep, s.replay_endpoint)
                    self.replay.serve(rep, s.replay_endpoint)
                except BaseException:
                    rep.close(linger=0)
                    raise
        except BaseException:  # a socket left open would hang the context's term
            self.close()
            raise
        self._live = True
        bound = [s.replay_endpoint, s.endpoint if binds(s.endpoint) else ""]
        self._ipc_files = [f for e in bound if e and (f := bound_ipc_file(e)) is not None]
        self._pending[s.topic_prefix.encode()] = [ev.AllBlocksCleared()]
        self.flush()
        log.info(
            "publishing KV events: %s %s%s (replay %s, topic %s<model>)",
            "binding" if binds(s.endpoint) else "connecting to",
            s.endpoint,
            " with CURVE" if self._curve.started and needs_curve(s.endpoint) else "",
            f"bound on {s.replay_endpoint}" if s.replay_endpoint else "off",
            s.topic_prefix,
        )

    def _bind_pub(self) -> zmq.Socket[Any]:
        """The PUB socket, bound or connected by vLLM's rule (:func:`binds`)."""
        pub = self._ctx.socket(zmq.PUB)
        heartbeat(pub, self.settings.heartbeat_timeout_s)
        pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
        pub.setsockopt(zmq.XPUB_NODROP, 1)  # full queue: EAGAIN (counted), not silence
        try:
            if binds(self.settings.endpoint):
                self._curve.secure(pub, self.settings.endpoint)
                pub.bind(self.settings.endpoint)
            else:
                pub.connect(self.settings.endpoint)
        except BaseException:
            pub.close(linger=0)
            raise
        return pub

    def close(self) -> None:
        """Send what is pending, then close both sockets (nothing waits for subscribers)."""
        if self._pub is not None:
            self.flush()
            self._pub.close(linger=0)
            self._pub = None
        self._live = False
        self.replay.close()
        self._curve.stop()
        self._ctx.term()
        for path, inode in self._ipc_files:
            remove_ipc(path, inode)
        self._ipc_files = []

    # -- what is watched ----------------------------------------------------------------

    def watch(self, view: CacheView, namespace: str, model: str, published: bool) -> list[int]:
        """A registration of ``view`` arrived: name its topic (or None when its
        namespace is not ``published``) and watch the disk tier's objects of the object
        groups a hit requires (:meth:`attach_disk`). Returns those object groups (their
        indices in the layout): the caller asks the index to tell this publisher of
        their partitions' objects (:meth:`~lmc_server.cache.index.L1Index.watch`)."""
        prefix = view.ns_prefix
        if prefix not in self._topics:
            topic = (self.settings.topic_prefix + model).encode() if published else None
            self._topics[prefix] = topic
            if topic is not None and topic not in self._models:
                self._models.add(topic)
                self._append(topic, ev.AllBlocksCleared())
        if self._topics[prefix] is None:
            return []  # its partitions are watched for the namespaces that are published
        groups = view.layout.object_groups
        has_full = any(og.has_full for og in groups)
        watched = []
        for og in groups:
            if og.has_full or (not has_full and og.index == 0):
                watched.append(og.index)
                self._watched.append((namespace, og.fingerprint, prefix))
                if self.disk is not None:
                    self.disk.watch(namespace, og.fingerprint, prefix)
        return watched

    def attach_disk(self, listeners: TierListeners) -> None:
        """Publish the disk tier's objects too (medium ``DISK``,
        :mod:`lmc_server.server.events.tiers`)."""
        self.disk = DiskEvents(self)
        listeners.subscribe(stored=self.disk.stored, removed=self.disk.removed)
        for namespace, fingerprint, prefix in self._watched:
            self.disk.watch(namespace, fingerprint, prefix)

    def staged(
        self, keys: list[bytes], fields: StoreEvents | None, per: int, salted: bool
    ) -> _Staging:
        """Context for committing one store: its objects are published with ``fields``
        (``per`` hashes per chunk), or not at all when the store was salted, in chunk
        order (the index commits a prefix from its end; a router resolves each block's
        parent, so it must hear of the parent first)."""
        stage = Stage(suppress=salted, chunk_size=self.chunk_size)
        if not salted:
            stage.per, stage.fields = per, fields
            stage.at = {k: i for i, k in enumerate(keys)}
        return _Staging(self, stage)

    # -- SlotWatcher (called by the index on the loop thread) ---------------------------

    def visible(self, key: bytes) -> None:
        topic = self._topics.get(key[:NS_BYTES])
        if topic is None or key in self._published:
            return
        stage = self._stage
        i = None
        if stage is not None:
            if stage.suppress:
                return
            i = stage.at.get(key)
        if i is None or stage is None or stage.fields is None:
            self._published[key] = None
            event = ev.BlockStored(
                block_hashes=[self.digest_hash(key)],
                parent_block_hash=None,
                token_ids=[],
                block_size=self.chunk_size,
                lora_id=None,
                medium=ev.MEDIUM_CPU,
                lora_name=None,
            )
        else:
            hashes, event = stage.stored(i)
            self._published[key] = hashes
        if stage is not None and i is not None:
            stage.out.append((i, topic, event))  # sent in chunk order when the commit ends
        else:
            self._append(topic, event)

    def gone(self, key: bytes) -> None:
        if key not in self._published:
            return
        hashes = self._published.pop(key)
        topic = self._topics[key[:NS_BYTES]]
        assert topic is not None
        self.remove(topic, key, hashes, ev.MEDIUM_CPU)

    def remove(self, topic: bytes, key: bytes, hashes: bytes | None, medium: str) -> None:
        """Publish that ``medium`` no longer holds the object of L1 key ``key`` (its
        encoded event hashes, None: derived from the digest); a run of removals of one
        medium becomes one event."""
        if hashes is None:
            hashes = b"\xcf" + key[_DIGEST_HASH]
        events = self._pending.get(topic)
        run = events[-1] if events else None
        if not isinstance(run, Removals) or run.medium != medium:
            run = Removals(medium)
            self._append(topic, run)
        run.parts.append(hashes)
        run.n += len(hashes) // ev.U64_ELEMENT_BYTES

    def digest_hash(self, key: bytes) -> int:
        """The event hash of an object stored without the connector's fields."""
        return int.from_bytes(key[_DIGEST_HASH], "big")

    # -- publishing ---------------------------------------------------------------------

    def topic_of(self, prefix: bytes) -> bytes | None:
        return self._topics.get(prefix)

    def published_hashes(self, key: bytes) -> tuple[bool, bytes | None]:
        """Whether the L1 object of ``key`` is published, and its encoded hashes."""
        return key in self._published, self._published.get(key)

    def append(self, topic: bytes, event: Any) -> None:
        self._append(topic, event)

    @property
    def published_objects(self) -> int:
        return len(self._published)

    @property
    def replay_batches(self) -> int:
        return len(self.replay)

    def _append(self, topic: bytes, event: Any) -> None:
        self._pending.setdefault(topic, []).append(event)
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Encode and send one batch per topic with events pending; never blocks."""
        self._flush_handle = None
        if not self._pending or not self._live:
            return
        if self._pub is None:
            self._reopen()
        pending, self._pending = self._pending, {}
        ts = self.wall_clock()
        for topic, events in pending.items():
            events = [e.event() if isinstance(e, Removals) else e for e in events]
            payload = ev.encode_batch(ev.KVEventBatch(ts=ts, events=events, data_parallel_rank=0))
            seq = self.next_seq
            self.next_seq += 1
            self.replay.keep(seq, topic, payload)
            self.stats.batches += 1
            self.stats.events += len(events)
            if self._pub is None:  # being re-created: kept for replay only
                self.stats.dropped_batches += 1
                continue
            try:
                self._pub.send_multipart((topic, ev.seq_frame(seq), payload), zmq.NOBLOCK)
                self._stalled_since = None
            except zmq.Again:
                self.stats.dropped_batches += 1
                self._stalled()

    def _stalled(self) -> None:
        """A send failed: a subscriber's queue is full. Past the heartbeat timeout of
        failures, re-create the PUB socket (see the module docstring)."""
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
            return
        if now - self._stalled_since <= self.settings.heartbeat_timeout_s or self._pub is None:
            return
        log.warning(
            "KV events: a subscriber blocked every batch for %.1f s (%d dropped "
            "so far); re-creating the socket, subscribers reconnect",
            now - self._stalled_since,
            self.stats.dropped_batches,
        )
        self._pub.close(linger=0)
        self._pub = None
        self._stalled_since = None
        self.stats.stall_resets += 1
        self._reopen()

    def _reopen(self) -> None:
        """A new PUB socket after a reset; if its endpoint is not free yet, the next
        batch tries again (batches meanwhile are kept for replay and counted dropped)."""
        try:
            self._pub = self._bind_pub()
        except zmq.ZMQError as e:
            log.warning(
                "KV events: cannot re-create the socket on %s yet: %s", self.settings.endpoint, e
            )


class _Staging:
    """``with publisher.staged(...)``: the store's fields apply while it commits."""

    def __init__(self, publisher: KvEventPublisher, stage: Stage) -> None:
        self.publisher = publisher
        self.stage = stage

    def __enter__(self) -> None:
        self.publisher._stage = self.stage

    def __exit__(self, *exc: object) -> None:
        p = self.publisher
        p._stage = None
        for _, topic, event in sorted(self.stage.out, key=lambda x: x[0]):
            p._append(topic, event)
