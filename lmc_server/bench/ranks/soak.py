"""Phase 2 of ``lmcache bench ranks`` (tensor-parallel mode): the correctness soak.

For ``duration_s`` every rank runs a store loop (fresh chunks, the same sequence on every
rank: the first to store a chunk copies, the others get ``EXISTS`` or ``IN_PROGRESS``)
and a retrieve loop (chunks it saw committed, every ``verify_every``-th one poisoned
first and compared byte for byte) on one connection. Apart from :mod:`.run` because it
is the one phase whose accounting is subtle: L1 must hold the distinct chunks stored
once, up to what eviction or a killed rank's unfinished writes make unknowable (reported
separately as ``unknown_bytes_phase2`` and ``evicted_bytes_phase2``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lmc_server.bench.ranks.config import MAX_ERRORS_KEPT, RanksConfig
from lmc_server.bench.ranks.procs import RankProcess, timed_phase, union_bits
from lmc_server.bench.ranks.serverload import ServerLoad
from lmc_server.client.sync import Client


def soak_phase(
    cfg: RanksConfig,
    ranks: Sequence[RankProcess],
    admin: Client,
    object_bytes: dict[str, int],
    raw: dict[str, Any],
    rows: list[dict[str, Any]],
    phase3: Callable[[RankProcess], None],
    load: Callable[[float], ServerLoad],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, bool]]:
    """Run phase 2 (``phase3`` kills the last rank halfway when ``kill_one``); returns
    the phase's summary, the L1 accounting and the checks; ``rows`` (one per rank) get
    each rank's phase-2 figures. ``load(seconds)`` reads the server's CPU over the
    phase from when it is called."""
    s0 = admin.stats()
    server_cpu = load(cfg.duration_s)
    cmd = {"cmd": "p2", "duration_s": cfg.duration_s, "verify_every": cfg.verify_every}
    survivors, got, wall_s = timed_phase(ranks, cmd, cfg.duration_s, cfg.kill_one, phase3)
    s1 = admin.stats()
    seconds = max(g["seconds"] for g in got)
    store_b = sum(g["store"]["copied_bytes"] for g in got)
    ret_b = sum(g["retrieve"]["copied_bytes"] for g in got)
    distinct = {og: union_bits(got, "committed_bits", og) for og in object_bytes}
    pending = {og: union_bits(got, "pending_bits", og) & ~distinct[og] for og in object_bytes}
    distinct_b = sum(int(distinct[og].sum()) * b for og, b in object_bytes.items())
    unknown_b = sum(int(pending[og].sum()) * b for og, b in object_bytes.items())
    copies_b = s1.counters.stored_bytes - s0.counters.stored_bytes
    evicted_b = s1.counters.evicted_bytes - s0.counters.evicted_bytes
    evicted_total = int(s1.counters.evicted_bytes)
    stored_total = int(s1.counters.stored_bytes)
    p2 = {
        "seconds": seconds,
        "wall_s": wall_s,
        "ranks_reporting": len(got),
        "store_bytes": store_b,
        "retrieve_bytes": ret_b,
        "store_gbps": store_b / seconds / 1e9,
        "retrieve_gbps": ret_b / seconds / 1e9,
        "mismatched_bytes": sum(g["mismatched_bytes"] for g in got),
        "checked_bytes": sum(g["checked_bytes"] for g in got),
        "verified_requests": sum(g["verified_requests"] for g in got),
        "errors": sum(g["store"]["errors"] + g["retrieve"]["errors"] for g in got),
        "failed_statuses": sum(
            g["store"]["status"]["failed"]
            + g["store"]["status"]["no_space"]
            + g["retrieve"]["status"]["failed"]
            for g in got
        ),
        "retrieve_misses": sum(g["retrieve"]["status"]["miss"] for g in got),
        "store_in_progress": sum(g["store"]["status"]["in_progress"] for g in got),
        "error_samples": [
            e for g in got for d in ("store", "retrieve") for e in g[d]["error_samples"]
        ][:MAX_ERRORS_KEPT],
    }
    p2["server_cpu"] = server_cpu.result()
    p2["store_ratio"] = p2["store_gbps"] / raw["d2h_gbps"] if raw["d2h_gbps"] else None
    p2["retrieve_ratio"] = p2["retrieve_gbps"] / raw["h2d_gbps"] if raw["h2d_gbps"] else None
    l1 = {
        "used_bytes": s1.l1.used_bytes,
        "capacity_bytes": s1.l1.capacity_bytes,
        "distinct_bytes_phase2": distinct_b,
        "copied_bytes_phase2": copies_b,
        "copies_per_distinct_chunk": copies_b / distinct_b if distinct_b else None,
        "one_copy_per_rank_bytes": cfg.ranks * distinct_b,
        "evicted_bytes_phase2": evicted_b,
        "unknown_bytes_phase2": unknown_b,
        # what L1 held when phase 2 began (phase 1, TP stores) plus phase 2's
        "single_copy_bytes": s0.l1.used_bytes + distinct_b - evicted_b,
        "writing_objects": sum(p.writing for p in s1.partitions),
    }
    by_rank = {r.rank: g for r, g in zip(survivors, got, strict=True)}
    for row in rows:
        g = by_rank.get(row["rank"])
        row.update(
            alive=g is not None,
            p2_store_gbps=g["store"]["copied_bytes"] / g["seconds"] / 1e9 if g else None,
            p2_retrieve_gbps=g["retrieve"]["copied_bytes"] / g["seconds"] / 1e9 if g else None,
            p2_errors=(g["store"]["errors"] + g["retrieve"]["errors"]) if g else None,
            p2_mismatched_bytes=g["mismatched_bytes"] if g else None,
        )
    checks = {
        "p2 survivors: no errors": p2["errors"] == 0 and p2["failed_statuses"] == 0,
        "p2 verified bytes match": p2["mismatched_bytes"] == 0 and p2["checked_bytes"] > 0,
        "p2 replicated KV copied once": (
            distinct_b <= copies_b <= distinct_b + unknown_b + evicted_b
        ),
        "p2 L1 used == stored - evicted": (l1["used_bytes"] == stored_total - evicted_total),
        "p2 no unfinished writes left": l1["writing_objects"] == 0,
    }
    if evicted_total == 0 and unknown_b == 0:
        checks["p2 L1 used == distinct chunks x chunk bytes"] = (
            l1["used_bytes"] == l1["single_copy_bytes"]
        )
    return p2, l1, checks
