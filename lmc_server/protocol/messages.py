"""Typed messages. One zmq frame carries one message (msgpack map with a ``type`` tag).

Every request carries a client-chosen ``req_id`` echoed by its reply, so a client may
pipeline requests on one connection. Digests are concatenated 32-byte chunk digests;
block ids are little-endian int32 arrays, one per registered group in registration
order (empty for scratch groups), ``blocks_per_chunk`` ids per chunk, ``-1`` meaning
"no block" (store: skip; retrieve: leave that block alone). Per-chunk statuses come
back as one byte per chunk (:class:`lmc_server.cache.status.ChunkStatus`), one
``bytes`` per object group in the order of ``Registered.object_groups``.
"""

from __future__ import annotations

import msgspec

from lmc_server.buffers import BufferSpec
from lmc_server.cache.geometry import GroupSpec
from lmc_server.protocol.stats import StatsReport


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    req_id: int = 0


# -- requests ---------------------------------------------------------------------------


class Hello(_Msg, frozen=True, tag="hello"):
    """First message on a connection: protocol version check."""

    protocol_version: int
    client_name: str = ""


class Register(_Msg, frozen=True, tag="register"):
    """Declare KV buffers and geometry; namespace fields decide what may be shared.

    ``replicated`` marks KV that every tensor-parallel rank holds identically (MLA):
    the namespace then omits the rank so one stored copy serves every rank. An empty
    ``buffers`` list makes a lookup-only registration (a scheduler) that may look up
    and release but not store or retrieve.
    """

    model: str
    kv_dtype: str
    arch: str
    groups: list[GroupSpec]
    world_size: int = 1
    rank: int = 0
    replicated: bool = False
    buffers: list[BufferSpec] = []


class Unregister(_Msg, frozen=True, tag="unregister"):
    registration_id: bytes


class Lookup(_Msg, frozen=True, tag="lookup"):
    """Longest prefix of ``digests`` that hits; with ``lease``, pin it for a retrieve."""

    registration_id: bytes
    digests: bytes
    salt: bytes = b""
    lease: bool = True


class LookupBatch(_Msg, frozen=True, tag="lookup_batch"):
    """Many lookups in one request (one per engine request of a scheduler step).

    ``digests`` and ``prefix_ends`` as in :class:`Retrieve`: chunks ``ends[i-1]..ends[i]``
    are lookup ``i``'s digests (chunks 0..n-1 of its prompt, chained from zero); the
    batch is bounded like one request (``max_chunks_per_request`` in all). Each lookup
    is answered exactly as :class:`Lookup` would answer it, with a lease of its own;
    ``salt`` applies to every one. The whole batch is checked before the first lease
    is taken: a refused batch pins nothing.
    """

    registration_id: bytes
    digests: bytes
    prefix_ends: bytes = b""
    salt: bytes = b""
    lease: bool = True


class Release(_Msg, frozen=True, tag="release"):
    lease_id: int


class Store(_Msg, frozen=True, tag="store"):
    """Copy chunks from the registration's blocks into L1.

    The client sends it only once the engine's writes to those blocks are complete (on
    CUDA: after an event recorded behind them has completed, waited for off the
    engine's thread, see :func:`lmc_server.client.cuda.stream_done`). The server reads
    the pages at once and makes the objects visible when its copy is done.
    """

    registration_id: bytes
    digests: bytes
    block_ids: list[bytes]
    salt: bytes = b""
    events: StoreEvents | None = None


class StoreEvents(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a KV-event subscriber (a router) needs of the stored chunks, which the
    server's digests cannot give it: the engine's own per-block hashes and the tokens.

    ``block_size`` tokens per engine block hash (``chunk_size`` a multiple of it);
    ``token_ids``: the chunks' tokens, uint32 LE, ``chunk_size`` per chunk;
    ``block_hashes``: uint64 BE, ``chunk_size // block_size`` per chunk;
    ``parent_hashes``: uint64 BE, one per chunk, the engine hash of the block before the
    chunk, 0 for a chunk that starts its prompt. Used only for chunks this store makes
    visible (docs/protocol.md gives the cost per chunk).
    """

    block_size: int
    token_ids: bytes
    block_hashes: bytes
    parent_hashes: bytes


class Retrieve(_Msg, frozen=True, tag="retrieve"):
    """Copy chunks from L1 into the registration's blocks; the last chunk ends the prefix.

    ``prefix_ends`` (int32 LE, strictly ascending, the last equal to the chunk count)
    batches several prefixes in one request: chunks ``ends[i-1]..ends[i]`` are one
    prefix, and sliding-window sections are read at the end of each. Empty: one prefix.
    """

    registration_id: bytes
    digests: bytes
    block_ids: list[bytes]
    salt: bytes = b""
    prefix_ends: bytes = b""


class Ping(_Msg, frozen=True, tag="ping"):
    pass


class Stats(_Msg, frozen=True, tag="stats"):
    pass


class Clear(_Msg, frozen=True, tag="clear"):
    """Evict every unpinned object (administration)."""


class Probe(_Msg, frozen=True, tag="probe"):
    """How many leading chunks of each prompt would hit, for a router: no registration,
    no lease, no effect on eviction order.

    ``namespace`` as ``Registered.namespace`` reports it; ``digests`` and
    ``prefix_ends`` as in :class:`Retrieve` (several prompts in one request). A
    namespace no registration ever declared hits nothing.
    """

    namespace: str
    digests: bytes
    salt: bytes = b""
    prefix_ends: bytes = b""


Request = (
    Hello
    | Register
    | Unregister
    | Lookup
    | LookupBatch
    | Release
    | Store
    | Retrieve
    | Ping
    | Stats
    | Clear
    | Probe
)

# -- replies ----------------------------------------------------------------------------


class Welcome(_Msg, frozen=True, tag="welcome"):
    protocol_version: int
    server_version: str
    chunk_size: int
    backend: str
    max_frame_bytes: int
    max_chunks_per_request: int
    #: Abstract unix socket taking shared-memory descriptors (cpu backend; "" if none).
    fd_socket: str = ""


class ObjectGroupInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    object_bytes: int
    groups: list[str]


class Registered(_Msg, frozen=True, tag="registered"):
    registration_id: bytes
    namespace: str
    chunk_size: int
    lookup_only: bool
    object_groups: list[ObjectGroupInfo]


class Unregistered(_Msg, frozen=True, tag="unregistered"):
    pass


class LookupResult(_Msg, frozen=True, tag="lookup_result", omit_defaults=True):
    """``hit_chunks`` leading chunks hit; ``lease_id`` is 0 when no lease was taken.

    ``l2_pending_chunks`` > 0: that many chunks after the hit are being fetched from
    the L2 tier into L1; look up again later (next scheduler step) to see them as hits.
    Omitted on the wire when 0 (always, without an L2 tier).
    """

    hit_chunks: int
    lease_id: int = 0
    lease_ttl_s: float = 0.0
    l2_pending_chunks: int = 0


class LookupBatchResult(_Msg, frozen=True, tag="lookup_batch_result", omit_defaults=True):
    """Per lookup of the batch, in order: ``hit_chunks`` (int32 LE) and ``lease_ids``
    (uint64 LE, 0: no lease taken), as :class:`LookupResult` gives them for one.

    ``lease_ttl_s``: every lease's TTL (0.0 when none was taken).
    ``l2_pending_chunks``: int32 LE per lookup as in :class:`LookupResult`; omitted
    (empty) when 0 for every lookup (always, without an L2 tier).
    """

    hit_chunks: bytes
    lease_ids: bytes
    lease_ttl_s: float = 0.0
    l2_pending_chunks: bytes = b""


class Released(_Msg, frozen=True, tag="released"):
    released: bool


class StoreResult(_Msg, frozen=True, tag="store_result"):
    statuses: list[bytes]


class RetrieveResult(_Msg, frozen=True, tag="retrieve_result"):
    statuses: list[bytes]


class Pong(_Msg, frozen=True, tag="pong"):
    server_version: str
    ready: bool


class StatsResult(_Msg, frozen=True, tag="stats_result"):
    """The ``stats`` report, typed (:mod:`lmc_server.protocol.stats`, docs/protocol.md)."""

    stats: StatsReport


class Cleared(_Msg, frozen=True, tag="cleared"):
    evicted: int


class ProbeResult(_Msg, frozen=True, tag="probe_result"):
    """Per prompt of the probe, its hit chunks (int32 LE); tokens = chunks x chunk size."""

    hit_chunks: bytes
    chunk_size: int


class Error(_Msg, frozen=True, tag="error"):
    code: str
    message: str


Reply = (
    Welcome
    | Registered
    | Unregistered
    | LookupResult
    | LookupBatchResult
    | Released
    | StoreResult
    | RetrieveResult
    | Pong
    | StatsResult
    | Cleared
    | ProbeResult
    | Error
)
