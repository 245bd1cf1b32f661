"""The notes and the table of ``lmcache bench ranks`` (from its report, nothing else)."""

from __future__ import annotations

from typing import Any

from lmc_server.bench.common import Report, format_table
from lmc_server.bench.ranks_config import KILL_DETECT_S, RanksConfig


def notes(report: Report, cfg: RanksConfig) -> None:
    raw = ("pinned cudaMemcpy on every GPU at once (testing.cuda_kv.raw_copy_gbps, one "
           "process per GPU), summed" if cfg.backend == "cuda" else
           "numpy copies shm <-> populated anonymous memory in every rank process at "
           "once, summed")
    report.notes += [
        f"raw = {raw}; ours = bytes copied by the server for all ranks (OK statuses x "
        "object bytes) / phase seconds",
        "phase 2: every rank stores the same fresh chunk sequence (the first copies, the "
        "others get EXISTS or IN_PROGRESS) and retrieves chunks it saw committed",
        "p2 single copy: distinct <= server stored bytes <= distinct + unknown (a killed "
        "rank's in-flight writes) + evicted (re-stored after eviction)",
    ]
    for name, ok in report.summary["checks"].items():
        report.notes.append(f"check {'PASS' if ok else 'FAIL'}: {name}")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def table(report: Report) -> str:
    """Per-rank rows, then the aggregate figures."""
    ranks = format_table(report.rows, [
        ("rank", "rank", "d"), ("device", "dev", "d"), ("alive", "alive", ""),
        ("p1_checked_bytes", "p1 checked B", "d"),
        ("p1_mismatched_bytes", "p1 mismatch B", "d"),
        ("tp_load_retrieve_gbps", "tp load GB/s", ".2f"),
        ("p2_store_gbps", "p2 store GB/s", ".2f"),
        ("p2_retrieve_gbps", "p2 retr GB/s", ".2f"),
        ("p2_errors", "p2 errors", "d"), ("p2_mismatched_bytes", "p2 mismatch B", "d")])
    s = report.summary
    p2, raw, l1 = s.get("phase2", {}), s.get("raw", {}), s.get("l1", {})
    agg = []
    for mode in ("load", "mixed"):
        tp = s.get(f"tp_{mode}")
        if tp is None:
            continue
        agg.append({"what": f"tp {mode}: retrieve GB/s (H2D), all ranks",
                    "ours": tp["retrieve_gbps"], "ref": raw.get("h2d_gbps"),
                    "ratio": tp["retrieve_ratio"]})
        if tp["store_requests"]:
            agg.append({"what": f"tp {mode}: store GB/s (D2H), rank 0",
                        "ours": tp["store_gbps"], "ref": raw.get("d2h_gbps"),
                        "ratio": tp["store_ratio"]})
    agg += [
        {"what": "p2 store GB/s (D2H), all ranks, with checks", "ours": p2.get("store_gbps"),
         "ref": raw.get("d2h_gbps"), "ratio": p2.get("store_ratio")},
        {"what": "p2 retrieve GB/s (H2D), all ranks, with checks",
         "ours": p2.get("retrieve_gbps"),
         "ref": raw.get("h2d_gbps"), "ratio": p2.get("retrieve_ratio")},
        {"what": "L1 used bytes vs one copy", "ours": l1.get("used_bytes"),
         "ref": l1.get("single_copy_bytes"), "ratio": None},
        {"what": "p2 bytes copied vs distinct", "ours": l1.get("copied_bytes_phase2"),
         "ref": l1.get("distinct_bytes_phase2"), "ratio": l1.get("copies_per_distinct_chunk")},
        {"what": "dead rank detected (s)", "ours": s.get("phase3", {}).get("detected_s"),
         "ref": KILL_DETECT_S, "ratio": None},
    ]
    rows = [{k: (_fmt(v) if k != "what" else v) for k, v in a.items()} for a in agg]
    totals = format_table(rows, [("what", "aggregate", ""), ("ours", "ours", ""),
                                 ("ref", "raw / expected", ""), ("ratio", "ratio", "")])
    return f"{ranks}\n\n{totals}\n\nresult: {'PASS' if s.get('ok') else 'FAIL'}"
