"""``lmcache bench ranks`` on CPU: real server, one process per rank, replicated KV.

The smoke test runs the subcommand small (4 ranks, 8 chunks, 3 s) and checks its JSON:
every byte every rank retrieved matched, the replicated chunks cost one copy of L1, the
surviving ranks saw no error and the killed rank's registration and mappings were
released. The byte checker the benchmark relies on is tested on its own first, so a
benchmark that compared nothing could not pass.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from lmc_server.bench.cli import bench
from lmc_server.bench.common import GeometryArgs
from lmc_server.bench.ranks_config import REGION_A, REGION_B, blocks_needed
from lmc_server.bench.ranks_kv import RankKV


def test_byte_checker_sees_unwritten_and_wrong_blocks() -> None:
    chunks = 4
    geometry = GeometryArgs(layers=2)
    cfg = {"rank": 0, "ranks": 1, "chunks": chunks, "batch": 2, "seed": 3,
           "backend": "cpu", "geometry": asdict(geometry),
           "num_blocks": blocks_needed(geometry.build(1), chunks, 256), "chunk_size": 256}
    w = RankKV(cfg)
    try:
        src, dst = np.arange(chunks), (np.arange(chunks) + 1) % chunks
        bad, checked = w.mismatch(src, dst, one_request=False)
        assert checked == chunks * w.layout.chunk_bytes and bad > checked // 2
        for g in w.kv.geometry.groups:  # copy A[src] into B[dst] by hand, page by page
            if not g.cached:
                continue
            a = w.slots.blocks(g.name, REGION_A, src)
            b = w.slots.blocks(g.name, REGION_B, dst)
            for layer in range(len(g.layers)):
                for x, y in zip(a, b, strict=True):
                    w.kv.page(g.name, layer, int(y))[:] = w.kv.page(g.name, layer, int(x))
        assert w.mismatch(src, dst, one_request=False) == (0, checked)
        w.kv.page("compressed", 0, int(w.slots.blocks("compressed", REGION_B, dst)[5]))[7] ^= 1
        assert w.mismatch(src, dst, one_request=False) == (1, checked)
        w.poison(dst[:2])  # one request of 2 chunks: window sections only for the last
        bad, checked2 = w.mismatch(src[:2], dst[:2])
        assert 0 < checked2 < 2 * w.layout.chunk_bytes and bad > checked2 // 2
    finally:
        w.kv.close()


def test_ranks_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    res = CliRunner().invoke(bench, [
        "ranks", "--ranks", "4", "--chunks", "8", "--duration-s", "3", "--layers", "2",
        "--batch", "4", "--verify-every", "1", "--raw-s", "0.1", "--l1-size-gb", "1",
        "--tp-s", "0.5", "--tp-chunks", "6", "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    s = r["summary"]
    assert s["ok"] and all(s["checks"].values()), s["checks"]
    chunk = r["config"]["chunk_bytes"]
    p1 = s["phase1"]
    assert p1["mismatched_bytes"] == 0 and p1["checked_bytes"] == 4 * 8 * chunk
    assert p1["l1_used_after_all"] == p1["one_copy_bytes"] == 8 * chunk
    assert p1["store_others_exists"] == [8 * 2] * 3  # two object groups, all EXISTS
    for mode in ("load", "mixed"):  # steady state: every rank loads the same prefix
        tp = s[f"tp_{mode}"]
        assert tp["chunks"] == 6 and tp["retrieve_requests"] >= 4 and tp["errors"] == 0
        assert tp["mismatched_bytes"] == 0 and tp["checked_bytes"] > 0
        assert len(tp["retrieve_gbps_per_rank"]) == 4 and min(tp["retrieve_gbps_per_rank"]) > 0
        assert tp["retrieve_gbps"] > 0 and tp["retrieve_ratio"] > 0
    assert s["tp_load"]["store_requests"] == 0 < s["tp_mixed"]["store_requests"]
    p2, l1 = s["phase2"], s["l1"]
    assert p2["errors"] == 0 and p2["mismatched_bytes"] == 0 and p2["checked_bytes"] > 0
    assert p2["store_gbps"] > 0 and p2["retrieve_gbps"] > 0 and p2["ranks_reporting"] == 3
    assert l1["copied_bytes_phase2"] == l1["distinct_bytes_phase2"] > 0
    if l1["evicted_bytes_phase2"] == 0:
        assert l1["used_bytes"] == l1["single_copy_bytes"] >= (
            8 * chunk + l1["distinct_bytes_phase2"])
    assert s["raw"]["d2h_gbps"] > 0 and s["raw"]["processes"] == 4
    p3 = s["phase3"]
    assert p3["victim_rank"] == 3 and p3["registrations_after"] == 3
    assert p3["detected_s"] is not None and p3["detected_s"] <= 5
    alive = {row["rank"]: row["alive"] for row in r["rows"]}
    assert alive == {0: True, 1: True, 2: True, 3: False}
    assert s["registrations_at_end"] == 0
    pids = {f"lmc-{row['pid']}-" for row in r["rows"]}  # the killed rank's too
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(tuple(pids))]
