"""The ``stats`` reply, typed: what ``StatsResult.stats`` carries (docs/protocol.md).

Built on demand by ``lmc_server.server.report`` (nothing is maintained for it on the hot
path), decoded by the clients, printed by ``lmcache stats`` (``--json``: these Structs as
JSON, keys as named here). The counters are the fields of
:class:`~lmc_server.cache.counters.CacheStats` and
:class:`~lmc_server.cache.counters.L2Counters`, inherited rather than written out again.

Compatibility: the Structs accept fields they do not know (a newer server of the same
protocol version may report more), so adding a field is not a protocol change; removing
or renaming one is.
"""

from __future__ import annotations

import msgspec

from lmc_server.cache.counters import CacheStats, KvEventCounters, L2Counters


class L1Report(msgspec.Struct, kw_only=True):
    """The pool: capacity and what is prepared, free and used."""

    capacity_bytes: int
    ready_bytes: int
    slab_bytes: int
    slabs: int
    ready_slabs: int
    free_slabs: int
    used_bytes: int
    objects: int


class PartitionReport(msgspec.Struct, kw_only=True):
    """One partition: one (namespace layout, object group), owning whole slabs."""

    name: str
    fingerprint: str  # hex of the layout fingerprint
    object_bytes: int
    slabs: int
    capacity_objects: int
    objects: int  # committed (visible)
    writing: int  # being written (invisible)
    used_bytes: int
    capacity_bytes: int
    pinned_objects: int


class Counters(CacheStats, kw_only=True):
    """Every :class:`CacheStats` counter, and requests answered by ``"op:outcome"``."""

    requests: dict[str, int] = {}


class PhaseSum(msgspec.Struct, kw_only=True):
    """Requests that went through a phase, and their seconds in it (sums since start)."""

    count: int
    seconds: float


class LatencySum(msgspec.Struct, kw_only=True):
    """Calls timed and their total seconds."""

    count: int
    sum: float


class L2Report(L2Counters, kw_only=True):
    """The L2 tier (with ``--l2``): every :class:`L2Counters` counter and its state."""

    url: str  # without credentials
    backend: str
    state: str  # "up" or "degraded"
    reason: str
    state_for_s: float
    write_queue_objects: int
    write_queue_capacity: int
    writes_in_flight: int
    read_seconds: LatencySum
    write_seconds: LatencySum


class DiskRebuild(msgspec.Struct, kw_only=True):
    """How far the disk tier's index rebuild is (hits are served meanwhile)."""

    done: bool
    fraction: float
    dirs_total: int
    dirs_done: int
    files: int
    bytes: int
    stale_tmp_removed: int
    seconds: float


class DiskReport(L2Report, kw_only=True):
    """The disk tier (with ``--disk-dir``): the L2 counters and state, plus its space."""

    capacity_bytes: int
    used_bytes: int  # in the directory, by every server sharing it (its ledger)
    files: int
    evicted_objects: int
    direct_io: bool
    rebuild: DiskRebuild


class KvEventsReport(KvEventCounters, kw_only=True):
    """The KV-event publisher (with ``--kv-events-endpoint``): its counters and state."""

    endpoint: str
    replay_endpoint: str
    next_seq: int  # the sequence number of the next batch
    replay_batches: int  # batches kept for replay now
    published_objects: int  # objects a subscriber was told of and not yet of their removal
    published_disk_objects: int = 0  # the same for the disk tier (medium DISK)


class StatsReport(msgspec.Struct, kw_only=True):
    """Configuration, capacity and use per partition, sessions, counters, phases, L2."""

    version: str
    backend: str
    chunk_size: int
    separate_object_groups: bool
    eviction_policy: str
    uptime_s: float
    l1: L1Report
    partitions: list[PartitionReport]
    sessions: int
    registrations: int
    leases: int
    counters: Counters
    #: ``"op:phase"`` -> sums (see ``lmc_server.server.stats.PHASES``).
    phases: dict[str, PhaseSum]
    l2: L2Report | None = None
    disk: DiskReport | None = None
    kv_events: KvEventsReport | None = None


__all__ = [
    "Counters",
    "DiskRebuild",
    "DiskReport",
    "KvEventsReport",
    "L1Report",
    "L2Report",
    "LatencySum",
    "PartitionReport",
    "PhaseSum",
    "StatsReport",
]
