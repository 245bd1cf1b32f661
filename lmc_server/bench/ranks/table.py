"""The notes and the tables of ``lmcache bench ranks`` (from its report, nothing else)."""

from __future__ import annotations

from typing import Any

from lmc_server.bench.common import Report, format_table
from lmc_server.bench.ranks.config import KILL_DETECT_S, RanksConfig
from lmc_server.bench.ranks.serverload import MARGIN_S


def notes(report: Report, cfg: RanksConfig) -> None:
    raw = (
        "pinned cudaMemcpy on every GPU at once (testing.cuda_kv.raw_copy_gbps, one "
        "process per GPU), summed"
        if cfg.backend == "cuda"
        else "numpy copies shm <-> populated anonymous memory in every rank process at once, summed"
    )
    report.notes.append(
        f"raw = {raw}; ours = bytes copied by the server for all ranks "
        "(OK statuses x object bytes) / phase seconds"
    )
    if cfg.mode == "dp":
        report.notes += [
            "dp: every engine is rank 0 of world size 1 (one namespace); each stores its "
            "own prompts and loads the hit prefix of a recent prompt of a random engine "
            "(itself included), at its own pace; cross-engine = loaded chunks another "
            "engine stored",
            "dp GB/s include the engines' byte checks of every loaded prefix (each runs on "
            "a thread while the engine's next load runs)",
        ]
    else:
        report.notes += [
            "phase 2: every rank stores the same fresh chunk sequence (the first copies, "
            "the others get EXISTS or IN_PROGRESS) and retrieves chunks it saw committed",
            "p2 single copy: distinct <= server stored bytes <= distinct + unknown (a "
            "killed rank's in-flight writes) + evicted (re-stored after eviction)",
        ]
    report.notes += [
        "server CPU (per timed phase, a window inside the phase leaving "
        f"min({MARGIN_S} s, a tenth of the phase) at each end): utime + stime of every "
        "thread of the server process (and any child) from /proc/<pid>/task/*/stat, "
        "grouped by thread name (loop: the event loop, tid == pid; copy_waiters, "
        "copy_threads, zmq_io: ZMQbg/*, cuda: the driver's own, pool, tiers, ...); "
        "requests = what the server answered in the window by its own counters, stats "
        "requests left out; busy = CPU s / wall s (per group: summed over its threads)",
        "sat req/s = req/s / the busiest thread's busy fraction: the rate at which that "
        "one thread would be 100% busy, an extrapolation that assumes its CPU per "
        "request stays the same at that rate (queueing, batching and a second "
        "bottleneck can change it either way)",
        "GIL busy = CPU of the server's Python threads together (all but ZMQ's I/O, "
        "CUDA's and the cpu engine's copy threads) / wall s: they take turns on one GIL, "
        "so GIL sat req/s = req/s / GIL busy is a lower bound on the ceiling where sat "
        "req/s is an upper one; a small --layers geometry with --cuda-copy-mode dma "
        "reaches the ceiling itself (the same copies per request, a fraction of the bytes)",
    ]
    for name, ok in report.summary["checks"].items():
        report.notes.append(f"check {'PASS' if ok else 'FAIL'}: {name}")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def _aggregate(agg: list[tuple[str, Any, Any, Any]]) -> str:
    """The aggregate figures: ``(what, ours, raw or expected, ratio)`` each."""
    rows = [
        dict(zip(("what", "ours", "ref", "ratio"), (w, *map(_fmt, v)), strict=True))
        for w, *v in agg
    ]
    return format_table(rows, "what|aggregate; ours|ours; ref|raw / expected; ratio|ratio")


def _load_row(phase: str, res: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One row of the server-CPU table from a phase's summary (its ``server_cpu``)."""
    cpu = res.get("server_cpu") or {}
    loop = cpu.get("groups", {}).get("loop", {})
    busiest = cpu.get("busiest_thread") or {}
    retrieve = res.get("retrieve_gbps", res.get("load_gbps"))
    return {
        "phase": phase,
        **extra,
        "rps": cpu.get("requests_per_s"),
        "gbps": retrieve,
        "ratio": res.get("retrieve_ratio", res.get("load_ratio")),
        "store_gbps": res.get("store_gbps") or None,  # "-": nothing stored
        "loop_busy": loop.get("busy"),
        "loop_us": loop.get("cpu_us_per_request"),
        # the event loop's OS name is the process name: say which thread it is
        "busiest": "loop" if busiest.get("group") == "loop" else busiest.get("name"),
        "busiest_busy": busiest.get("busy"),
        "sat_rps": cpu.get("saturation_requests_per_s"),
        "gil_busy": cpu.get("gil_busy"),
        "gil_sat_rps": cpu.get("gil_saturation_requests_per_s"),
        "error": cpu.get("error"),
    }


def server_load_table(report: Report) -> str:
    """A row per timed phase: its rate, GB/s and the server's CPU (``server_cpu``)."""
    s = report.summary
    rows = [
        _load_row(f"tp {t['mode']}", t, chunks=t["chunks"], inflight=t["inflight"])
        for t in s.get("tp", [])
    ]
    if "phase2" in s:
        rows.append(_load_row("phase 2", s["phase2"], chunks=report.config.get("batch")))
    if "dp" in s:
        rows.append(_load_row("dp", s["dp"], chunks=s["dp"].get("prompt_chunks")))
    if not rows:
        return ""
    table = format_table(
        rows,
        (
            "phase|phase; chunks|chunks|d; inflight|in flight|d; rps|req/s|,.0f; "
            "gbps|retr GB/s|.2f; ratio|of raw|.3f; store_gbps|store GB/s|.2f; "
            "loop_busy|loop busy|.2f; loop_us|loop us/req|,.0f; busiest|busiest thread; "
            "busiest_busy|its busy|.2f; sat_rps|sat req/s|,.0f; gil_busy|GIL busy|.2f; "
            "gil_sat_rps|GIL sat req/s|,.0f"
        ),
    )
    errors = [f"{r['phase']}: server CPU not read ({r['error']})" for r in rows if r["error"]]
    return "\n".join([table, *errors])


def _dp_table(report: Report) -> str:
    engines = format_table(
        report.rows,
        (
            "engine|engine|d; device|dev|d; alive|alive; store_gbps|store GB/s|.2f; "
            "load_gbps|load GB/s|.2f; stored_prompts|prompts|d; loads|loads|d; "
            "lookup_misses|lookup misses|d; cross_engine_chunks|cross-engine chunks|d; "
            "own_chunks|own chunks|d; verified_loads|verified|d; "
            "mismatched_bytes|mismatch B|d; failed_chunks|failed|d; errors|errors|d"
        ),
    )
    s = report.summary
    dp, raw = s.get("dp", {}), s.get("raw", {})
    agg = [
        ("store GB/s (D2H), all engines", *_of(dp, raw, "store", "d2h")),
        ("load GB/s (H2D), all engines", *_of(dp, raw, "load", "h2d")),
        ("cross-engine chunks loaded", dp.get("cross_engine_chunks"), None, None),
        ("loads verified / loads", dp.get("verified_loads"), dp.get("loads"), None),
        ("mismatched bytes / checked", dp.get("mismatched_bytes"), dp.get("checked_bytes"), None),
        ("failed chunks", dp.get("failed_chunks"), 0, None),
        ("dead engine detected (s)", s.get("phase3", {}).get("detected_s"), KILL_DETECT_S, None),
    ]
    return _joined([engines, _aggregate(agg), server_load_table(report)], bool(s.get("ok")))


def _of(res: dict[str, Any], raw: dict[str, Any], op: str, direction: str) -> tuple[Any, ...]:
    """``op``'s GB/s in a phase's summary, the raw copy's in ``direction``, their ratio."""
    return res.get(f"{op}_gbps"), raw.get(f"{direction}_gbps"), res.get(f"{op}_ratio")


def _joined(parts: list[str], ok: bool) -> str:
    """The tables (an empty one left out) and the verdict, a blank line apart."""
    return "\n\n".join([*(p for p in parts if p), f"result: {'PASS' if ok else 'FAIL'}"])


def table(report: Report) -> str:
    """Per-rank (per-engine) rows, then the aggregate figures."""
    if report.config.get("mode") == "dp":
        return _dp_table(report)
    ranks = format_table(
        report.rows,
        (
            "rank|rank|d; device|dev|d; alive|alive; p1_checked_bytes|p1 checked B|d; "
            "p1_mismatched_bytes|p1 mismatch B|d; tp_load_retrieve_gbps|tp load GB/s|.2f; "
            "p2_store_gbps|p2 store GB/s|.2f; p2_retrieve_gbps|p2 retr GB/s|.2f; "
            "p2_errors|p2 errors|d; p2_mismatched_bytes|p2 mismatch B|d"
        ),
    )
    s = report.summary
    p2, raw, l1 = s.get("phase2", {}), s.get("raw", {}), s.get("l1", {})
    agg = []
    for mode in ("load", "mixed"):  # a grid's TP phases are in the server-CPU table
        tp = s.get(f"tp_{mode}")
        if tp is not None:
            agg.append(
                (f"tp {mode}: retrieve GB/s (H2D), all ranks", *_of(tp, raw, "retrieve", "h2d"))
            )
            if tp["store_requests"]:
                agg.append((f"tp {mode}: store GB/s (D2H), rank 0", *_of(tp, raw, "store", "d2h")))
    agg += [
        ("p2 store GB/s (D2H), all ranks, with checks", *_of(p2, raw, "store", "d2h")),
        ("p2 retrieve GB/s (H2D), all ranks, with checks", *_of(p2, raw, "retrieve", "h2d")),
        ("L1 used bytes vs one copy", l1.get("used_bytes"), l1.get("single_copy_bytes"), None),
        (
            "p2 bytes copied vs distinct",
            l1.get("copied_bytes_phase2"),
            l1.get("distinct_bytes_phase2"),
            l1.get("copies_per_distinct_chunk"),
        ),
        ("dead rank detected (s)", s.get("phase3", {}).get("detected_s"), KILL_DETECT_S, None),
    ]
    return _joined([ranks, _aggregate(agg), server_load_table(report)], bool(s.get("ok")))
