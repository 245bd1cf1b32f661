"""The ``stats`` report: configuration, capacity and use per partition, counters.

Built on demand from the plain counters and the index (nothing is maintained for it on
the hot path); keys are documented in docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

from lmc_server import __version__
from lmc_server.cache.index import L1Index
from lmc_server.config import Config
from lmc_server.server.sessions import SessionTable
from lmc_server.server.stats import ServerStats


def build_report(config: Config, backend: str, index: L1Index, sessions: SessionTable,
                 stats: ServerStats, uptime_s: float,
                 l2: dict[str, Any] | None = None) -> dict[str, Any]:
    pool = index.pool
    parts = []
    for p in index.partitions.values():
        parts.append({
            "name": p.name, "fingerprint": p.fingerprint.hex(),
            "object_bytes": p.object_bytes, "slabs": p.slabs,
            "capacity_objects": p.capacity_objects, "objects": p.n_committed,
            "writing": p.n_writing, "used_bytes": p.used_bytes,
            "capacity_bytes": p.slabs * pool.slab_bytes,
            "pinned_objects": sum(1 for x in p.pins if x),
        })
    s = index.stats
    return {
        "version": __version__,
        "backend": backend,
        "chunk_size": config.chunk_size,
        "separate_object_groups": config.separate_object_groups,
        "eviction_policy": config.eviction_policy,
        "uptime_s": round(uptime_s, 3),
        "l1": {
            "capacity_bytes": pool.capacity_bytes, "ready_bytes": pool.ready_bytes,
            "slab_bytes": pool.slab_bytes, "slabs": pool.n_slabs,
            "ready_slabs": pool.ready_slabs, "free_slabs": pool.free_slabs,
            "used_bytes": sum(p.used_bytes for p in index.partitions.values()),
            "objects": sum(p.n_committed for p in index.partitions.values()),
        },
        "partitions": parts,
        "sessions": len(sessions),
        "registrations": sessions.registrations,
        "leases": len(index.leases),
        "counters": {
            "lookups": s.lookups, "lookup_chunks": s.lookup_chunks,
            "hit_chunks": s.hit_chunks, "lookup_tokens": stats.lookup_tokens,
            "hit_tokens": stats.hit_tokens, "stored_objects": s.stored_objects,
            "stored_bytes": s.stored_bytes, "retrieved_objects": s.retrieved_objects,
            "retrieved_bytes": s.retrieved_bytes, "evictions": s.evictions,
            "evicted_bytes": s.evicted_bytes, "slabs_moved": s.slabs_moved,
            "leases_taken": s.leases_taken, "leases_released": s.leases_released,
            "leases_expired": s.leases_expired,
            "alloc_failures": dict(s.alloc_failures),
            "requests": {f"{op}:{outcome}": n
                         for (op, outcome), n in sorted(stats.requests.items())},
        },
        "phases": {f"{op}:{phase}": {"count": int(n), "seconds": seconds}
                   for (op, phase), (n, seconds) in sorted(stats.phases.items())},
        "l2": l2,
    }
