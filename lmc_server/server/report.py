"""The ``stats`` report: configuration, capacity and use per partition, counters.

Built on demand from the plain counters and the index (nothing is maintained for it on
the hot path) as the typed :class:`~lmc_server.protocol.stats.StatsReport`; the fields
are documented in docs/protocol.md. Counters are copied field by field from their one
definition (:mod:`lmc_server.cache.counters`), never listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from lmc_server import __version__
from lmc_server.cache.counters import CacheStats, KvEventCounters, L2Counters
from lmc_server.cache.index import L1Index
from lmc_server.config import Config
from lmc_server.protocol.stats import (
    Counters,
    DiskRebuild,
    DiskReport,
    KvEventsReport,
    L1Report,
    L2Report,
    LatencySum,
    PartitionReport,
    PhaseSum,
    StatsReport,
)
from lmc_server.server.sessions import SessionTable
from lmc_server.server.stats import ServerStats

if TYPE_CHECKING:  # the tiers below L1 are imported only with --l2 or --disk-dir
    from lmc_server.server.events.publisher import KvEventPublisher
    from lmc_server.tiers.chain import TierChain
    from lmc_server.tiers.tier import L2Tier


def copy_counters(source: msgspec.Struct, cls: type[msgspec.Struct]) -> dict[str, Any]:
    """Every field of ``cls`` read from ``source``; dicts copied (the loop mutates them)."""
    out: dict[str, Any] = {}
    for name in cls.__struct_fields__:
        v = getattr(source, name)
        out[name] = dict(v) if isinstance(v, dict) else v
    return out


def build_report(
    config: Config,
    backend: str,
    index: L1Index,
    sessions: SessionTable,
    stats: ServerStats,
    uptime_s: float,
    tiers: TierChain | None = None,
    events: KvEventPublisher | None = None,
) -> StatsReport:
    pool = index.pool_usage()
    parts = [
        PartitionReport(
            name=u.name,
            fingerprint=u.fingerprint.hex(),
            object_bytes=u.object_bytes,
            slabs=u.slabs,
            capacity_objects=u.capacity_objects,
            objects=u.objects,
            writing=u.writing,
            used_bytes=u.used_bytes,
            capacity_bytes=u.capacity_bytes,
            pinned_objects=u.pinned_objects,
        )
        for u in index.usage()
    ]
    return StatsReport(
        version=__version__,
        backend=backend,
        chunk_size=config.chunk_size,
        separate_object_groups=config.separate_object_groups,
        eviction_policy=config.eviction_policy,
        uptime_s=round(uptime_s, 3),
        l1=L1Report(
            capacity_bytes=pool.capacity_bytes,
            ready_bytes=pool.ready_bytes,
            slab_bytes=pool.slab_bytes,
            slabs=pool.slabs,
            ready_slabs=pool.ready_slabs,
            free_slabs=pool.free_slabs,
            used_bytes=sum(p.used_bytes for p in parts),
            objects=sum(p.objects for p in parts),
        ),
        partitions=parts,
        sessions=len(sessions),
        registrations=sessions.registrations,
        leases=index.lease_count,
        counters=Counters(
            **copy_counters(index.stats, CacheStats),
            requests={f"{op}:{outcome}": n for (op, outcome), n in sorted(stats.requests.items())},
        ),
        phases={
            f"{op}:{phase}": PhaseSum(count=int(n), seconds=seconds)
            for (op, phase), (n, seconds) in sorted(stats.phases.items())
        },
        l2=_tier_report(tiers, "l2", l2_report),
        disk=_tier_report(tiers, "disk", disk_report),
        kv_events=None
        if events is None
        else KvEventsReport(
            **copy_counters(events.stats, KvEventCounters),
            endpoint=events.settings.endpoint,
            replay_endpoint=events.settings.replay_endpoint,
            next_seq=events.next_seq,
            replay_batches=events.replay_batches,
            published_objects=events.published_objects,
            published_disk_objects=0 if events.disk is None else len(events.disk),
        ),
    )


def _tier_report(tiers: TierChain | None, kind: str, report: Any) -> Any:
    tier = None if tiers is None else tiers.tier(kind)
    return None if tier is None else report(tier)


def l2_report(tier: L2Tier) -> L2Report:
    """The ``l2`` part: the tier's state, its write queue and its counters."""
    s = tier.stats
    return L2Report(
        **copy_counters(s, L2Counters),
        url=tier.display_url,
        backend=tier.backend.name,
        state="up" if tier.up else "degraded",
        reason=tier.state_reason,
        state_for_s=round(tier.clock() - tier.state_since_s, 3),
        write_queue_objects=tier.writer.depth,
        write_queue_capacity=tier.writer.max_objects,
        writes_in_flight=tier.writer.in_flight,
        read_seconds=LatencySum(count=s.read_latency.count, sum=s.read_latency.seconds),
        write_seconds=LatencySum(count=s.write_latency.count, sum=s.write_latency.seconds),
    )


def disk_report(tier: L2Tier) -> DiskReport:
    """The ``disk`` part: what ``l2`` says of a tier, plus the disk's space and index."""
    from lmc_server.tiers.disk.backend import FileBackend

    backend = tier.backend
    assert isinstance(backend, FileBackend)
    p = backend.index.progress
    return DiskReport(
        **msgspec.structs.asdict(l2_report(tier)),
        capacity_bytes=backend.index.capacity_bytes,
        used_bytes=backend.ledger.used_bytes,
        files=len(backend.index.entries),
        evicted_objects=backend.evicted_objects,
        direct_io=backend.direct,
        rebuild=DiskRebuild(
            done=p.done,
            fraction=round(p.fraction, 4),
            dirs_total=p.dirs_total,
            dirs_done=p.dirs_done,
            files=p.files,
            bytes=p.bytes,
            stale_tmp_removed=p.stale_tmp_removed,
            seconds=round(p.seconds, 3),
        ),
    )
