"""The DP phase of ``lmcache bench ranks --mode dp``: independent engines, one server.

DeepSeek-V4-Flash serves long contexts faster data-parallel than tensor-parallel, so one
server is often shared by several independent engines (world size 1 each, same model,
hence one namespace) rather than by the ranks of one engine in lockstep. Each engine
process (:mod:`.dp_worker`) first stores one seed prompt (the only barrier, before
the timed phase), then for ``duration_s`` stores its own prompts and loads prefixes of
any engine's prompts at its own pace, checking every loaded prefix byte for byte
against what its storer wrote.

Reported: per-engine and aggregate store and load GB/s (against the raw copy of the same
run, per direction), cross-engine hits (chunks an engine loaded that another engine
stored) and own hits, lookups that hit nothing, the byte checks, failed chunks. With
``kill_one`` the last engine is killed halfway and the others must not notice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lmc_server.bench.ranks.config import DP_LOAD_COUNTS, MAX_ERRORS_KEPT, RanksConfig
from lmc_server.bench.ranks.procs import RankProcess, gather, timed_phase
from lmc_server.bench.ranks.serverload import ServerLoad
from lmc_server.client.sync import Client

#: The counts of an engine's reply that rows show and the phase sums, in report order.
_SUMMED = (
    *DP_LOAD_COUNTS[:7],
    "failed_store_chunks",
    *DP_LOAD_COUNTS[7:],
    "stored_prompts",
)


def _row(r: RankProcess, g: dict[str, Any] | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "engine": r.rank,
        "pid": r.info["pid"],
        "device": r.info["device"],
        "alive": g is not None,
    }
    if g is None:
        return row
    row.update({k: g[k] for k in _SUMMED})
    row.update(
        store_gbps=g["store"]["copied_bytes"] / g["seconds"] / 1e9,
        load_gbps=g["load"]["copied_bytes"] / g["seconds"] / 1e9,
        errors=g["store"]["errors"] + g["load"]["errors"],
        failed_chunks=g["failed_store_chunks"] + g["failed_load_chunks"],
        verify_s=g["verify_s"],
        seconds=g["seconds"],
    )
    return row


def dp_phase(
    cfg: RanksConfig,
    engines: Sequence[RankProcess],
    admin: Client,
    raw: dict[str, Any],
    kill: Callable[[RankProcess], None],
    load: Callable[[float], ServerLoad],
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, bool]]:
    """Seed, run and sum the DP phase: ``(summary, rows, checks)``. ``kill`` is called
    with the last engine halfway through when ``cfg.kill_one`` (phase 3); ``load``
    reads the server's CPU over the timed phase."""
    seeds = gather(engines, {"cmd": "dp_seed"}, 600)
    s0 = admin.stats()
    server_cpu = load(cfg.duration_s)
    cmd = {"cmd": "dp", "duration_s": cfg.duration_s}
    survivors, got, wall_s = timed_phase(engines, cmd, cfg.duration_s, cfg.kill_one, kill)
    s1 = admin.stats()
    seconds = max(g["seconds"] for g in got)
    res: dict[str, Any] = {
        "engines": len(engines),
        "engines_reporting": len(got),
        "prompt_chunks": cfg.batch,
        "seconds": seconds,
        "wall_s": wall_s,
    }
    res.update({k: sum(g[k] for g in got) for k in _SUMMED})
    for d, key, srv in (
        ("store", "d2h_gbps", "stored_bytes"),
        ("load", "h2d_gbps", "retrieved_bytes"),
    ):
        nbytes = sum(g[d]["copied_bytes"] for g in got)
        res[f"{d}_bytes"] = nbytes
        res[f"{d}_gbps"] = nbytes / seconds / 1e9
        res[f"{d}_ratio"] = res[f"{d}_gbps"] / raw[key] if raw[key] else None
        res[f"{d}_requests"] = sum(g[d]["requests"] for g in got)
        res[f"{d}_ms_per_request"] = (
            1e3 * sum(g[d]["busy_s"] for g in got) / res[f"{d}_requests"]
            if res[f"{d}_requests"]
            else None
        )
        res[f"{d}_gbps_per_engine"] = [g[d]["copied_bytes"] / g["seconds"] / 1e9 for g in got]
        res[f"server_{srv}"] = getattr(s1.counters, srv) - getattr(s0.counters, srv)
    res["failed_chunks"] = res["failed_store_chunks"] + res["failed_load_chunks"]
    res["server_cpu"] = server_cpu.result()
    res["errors"] = sum(g[d]["errors"] for g in got for d in ("store", "load"))
    res["error_samples"] = [
        e for g in got for d in ("store", "load") for e in g[d]["error_samples"]
    ][:MAX_ERRORS_KEPT]
    res["verify_s_per_engine"] = [g["verify_s"] for g in got]
    res["seed_failed_chunks"] = sum(
        s["status"]["failed"] + s["status"]["no_space"] + s["errors"] for s in seeds
    )
    by_engine = {e.rank: g for e, g in zip(survivors, got, strict=True)}
    rows = [_row(e, by_engine.get(e.rank)) for e in engines]
    # what the survivors copied; a killed engine's copies count on the server only
    same = (
        (lambda ours, server: ours == server)
        if len(survivors) == len(engines)
        else (lambda ours, server: ours <= server)
    )
    checks = {
        "dp every engine seeded a prompt": res["seed_failed_chunks"] == 0,
        "dp no errors, no failed chunks": res["errors"] == 0 and res["failed_chunks"] == 0,
        "dp stores and loads ran": res["store_requests"] > 0 and res["loads"] > 0,
        "dp every loaded prefix verified, bytes match": (
            res["verified_loads"] == res["loads"]
            and res["checked_bytes"] > 0
            and res["mismatched_bytes"] == 0
        ),
        "dp server copied what the engines counted": (
            same(res["store_bytes"], res["server_stored_bytes"])
            and same(res["load_bytes"], res["server_retrieved_bytes"])
        ),
    }
    if len(engines) > 1:
        checks["dp cross-engine hits"] = res["cross_engine_chunks"] > 0
    return res, rows, checks
