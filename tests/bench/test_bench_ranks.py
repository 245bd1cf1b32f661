"""``lmcache bench ranks`` on CPU: real server, one process per rank, replicated KV.

The smoke test runs the subcommand small (4 ranks, 8 chunks, 3 s) and checks its JSON:
every byte every rank retrieved matched, the replicated chunks cost one copy of L1, the
surviving ranks saw no error and the killed rank's registration and mappings were
released. The byte checker the benchmark relies on is tested on its own first, so a
benchmark that compared nothing could not pass.

The DP mode (independent engines, world size 1 each) gets the same: its tagged byte
checker on its own (a prompt's bytes differ from every other prompt's stored from the
same slots), then a small run (3 engines, one killed) whose engines must share one
namespace, load chunks other engines stored and find every byte of every load right.

Every timed phase reports the server's CPU by thread (``server_cpu``); the runs check
it is there and plausible, and a third run takes the TP grid form (lists of chunks per
request and requests in flight), one entry per pair.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner

from lmc_server.bench.cli import bench
from lmc_server.bench.common import GeometryArgs
from lmc_server.bench.ranks.config import REGION_A, REGION_B, TAG_BYTES, blocks_needed
from lmc_server.bench.ranks.kv import RankKV

PNG = b"\x89PNG\r\n\x1a\n"


def assert_server_cpu_plausible(cpu: dict[str, Any]) -> None:
    """A phase's ``server_cpu``: read, requests served, the loop busy, rates consistent."""
    assert "error" not in cpu, cpu
    assert cpu["requests"] > 0 and cpu["wall_s"] > 0 and cpu["requests_per_s"] > 0, cpu
    loop = cpu["groups"]["loop"]
    assert loop["threads"] == 1 and loop["cpu_s"] > 0 and loop["cpu_us_per_request"] > 0, cpu
    for g in cpu["groups"].values():
        assert 0 <= g["busy"] <= 1.5 * g["threads"], cpu
    busiest = cpu["busiest_thread"]
    assert 0 < busiest["busy"] <= 1.5 and busiest["cpu_us_per_request"] > 0, cpu
    assert busiest["busy"] >= loop["busy"], cpu
    assert cpu["saturation_requests_per_s"] >= cpu["requests_per_s"], cpu
    assert cpu["loop_saturation_requests_per_s"] >= cpu["saturation_requests_per_s"], cpu
    assert cpu["gil_busy"] >= loop["busy"], cpu
    assert cpu["requests_per_s"] <= cpu["gil_saturation_requests_per_s"], cpu
    assert cpu["gil_saturation_requests_per_s"] <= cpu["loop_saturation_requests_per_s"], cpu
    assert cpu["requests_by_op"], cpu


def _rank_kv(chunks: int) -> RankKV:
    geometry = GeometryArgs(layers=2)
    return RankKV(
        {
            "rank": 0,
            "ranks": 1,
            "chunks": chunks,
            "batch": 2,
            "seed": 3,
            "backend": "cpu",
            "geometry": asdict(geometry),
            "num_blocks": blocks_needed(geometry.build(1), chunks, 256),
            "chunk_size": 256,
        }
    )


def _copy_a_to_b(w: RankKV, src: np.ndarray, dst: np.ndarray) -> None:
    """What a retrieve of every section does: A[src] into B[dst], page by page."""
    for g in w.kv.geometry.groups:
        if not g.cached:
            continue
        a = w.slots.blocks(g.name, REGION_A, src)
        b = w.slots.blocks(g.name, REGION_B, dst)
        for layer in range(len(g.layers)):
            for x, y in zip(a, b, strict=True):
                w.kv.page(g.name, layer, int(y))[:] = w.kv.page(g.name, layer, int(x))


def test_byte_checker_sees_unwritten_and_wrong_blocks() -> None:
    chunks = 4
    w = _rank_kv(chunks)
    try:
        src, dst = np.arange(chunks), (np.arange(chunks) + 1) % chunks
        bad, checked = w.mismatch(src, dst, one_request=False)
        assert checked == chunks * w.layout.chunk_bytes and bad > checked // 2
        _copy_a_to_b(w, src, dst)
        assert w.mismatch(src, dst, one_request=False) == (0, checked)
        w.kv.page("compressed", 0, int(w.slots.blocks("compressed", REGION_B, dst)[5]))[7] ^= 1
        assert w.mismatch(src, dst, one_request=False) == (1, checked)
        w.poison(dst[:2])  # one request of 2 chunks: window sections only for the last
        bad, checked2 = w.mismatch(src[:2], dst[:2])
        assert 0 < checked2 < 2 * w.layout.chunk_bytes and bad > checked2 // 2
    finally:
        w.kv.close()


def test_tagged_checker_tells_prompts_from_the_same_slots_apart() -> None:
    chunks = 4
    w = _rank_kv(chunks)
    try:
        src, dst = np.arange(chunks), np.arange(chunks)
        w.tag(src, prompt=7)  # what a DP engine does before storing prompt 7
        _copy_a_to_b(w, src, dst)  # ... and what a retrieve of it writes
        bad, checked = w.mismatch(src, dst, one_request=False, prompt=7)
        assert bad == 0 and checked == chunks * w.layout.chunk_bytes
        pages = sum(
            len(g.layers) * w.slots.bpc[g.name] * chunks for g in w.kv.geometry.groups if g.cached
        )
        # prompt 15 is stored from the same slots: only its tags tell it apart
        bad, _ = w.mismatch(src, dst, one_request=False, prompt=15)
        assert 0 < bad <= pages * TAG_BYTES
        w.tag(src[:1], prompt=15)  # the slots now hold prompt 15's first chunk ...
        assert w.mismatch(src, dst, one_request=False, prompt=7) == (0, checked)
        w.poison(dst[:2], one_request=False)  # ... B keeps 7's; a poisoned B fails
        bad, _ = w.mismatch(src, dst, one_request=False, prompt=7)
        assert bad > w.layout.chunk_bytes
    finally:
        w.kv.close()


def test_ranks_dp_cpu_smoke(tmp_path: Path) -> None:
    out, png = tmp_path / "dp.json", tmp_path / "dp.png"
    res = CliRunner().invoke(
        bench,
        [
            "ranks",
            "--mode",
            "dp",
            "--ranks",
            "3",
            "--chunks",
            "8",
            "--batch",
            "4",
            "--duration-s",
            "1.5",
            "--layers",
            "2",
            "--raw-s",
            "0.1",
            "--l1-size-gb",
            "1",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == PNG
    r = json.loads(out.read_text())
    assert r["benchmark"] == "ranks" and r["config"]["mode"] == "dp"
    assert "world=1;rank=replicated" in r["config"]["namespace"]  # one, for every engine
    s = r["summary"]
    assert s["ok"] and all(s["checks"].values()), s["checks"]
    dp = s["dp"]
    assert dp["engines"] == 3 and dp["engines_reporting"] == 2 and dp["prompt_chunks"] == 4
    assert dp["cross_engine_chunks"] > 0 and dp["mismatched_bytes"] == 0
    assert dp["verified_loads"] == dp["loads"] > 0 and dp["checked_bytes"] > 0
    assert dp["failed_chunks"] == 0 and dp["errors"] == 0
    assert dp["store_gbps"] > 0 and dp["load_gbps"] > 0 and dp["load_ratio"] > 0
    assert len(dp["load_gbps_per_engine"]) == 2 and min(dp["load_gbps_per_engine"]) > 0
    assert dp["store_bytes"] <= dp["server_stored_bytes"]  # the killed engine's too
    assert_server_cpu_plausible(dp["server_cpu"])
    assert {"store", "lookup", "retrieve"} <= set(dp["server_cpu"]["requests_by_op"])
    rows = {row["engine"]: row for row in r["rows"]}
    assert {e: row["alive"] for e, row in rows.items()} == {0: True, 1: True, 2: False}
    assert sum(rows[e]["cross_engine_chunks"] for e in (0, 1)) == dp["cross_engine_chunks"]
    assert s["phase3"]["victim_rank"] == 2 and s["phase3"]["detected_s"] is not None
    assert s["registrations_at_end"] == 0
    pids = {f"lmc-{row['pid']}-" for row in r["rows"]}
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(tuple(pids))]


def test_ranks_dp_refuses_a_region_too_small_for_two_prompts() -> None:
    res = CliRunner().invoke(
        bench, ["ranks", "--mode", "dp", "--chunks", "7", "--batch", "4", "--layers", "2"]
    )
    assert res.exit_code == 2
    assert "--chunks 7" in res.output and "twice --batch (8)" in res.output


def test_ranks_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    res = CliRunner().invoke(
        bench,
        [
            "ranks",
            "--ranks",
            "4",
            "--chunks",
            "8",
            "--duration-s",
            "1.5",
            "--layers",
            "2",
            "--batch",
            "4",
            "--verify-every",
            "1",
            "--raw-s",
            "0.1",
            "--l1-size-gb",
            "1",
            "--tp-s",
            "0.5",
            "--tp-chunks",
            "6",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "ranks.png"),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "ranks.png").read_bytes()[:8] == PNG
    r = json.loads(out.read_text())
    assert r["config"]["mode"] == "tp" and "world=4;rank=replicated" in r["config"]["namespace"]
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
    assert [t["mode"] for t in s["tp"]] == ["load", "mixed"]  # the one pair, both modes
    assert s["tp"][0] == s["tp_load"] and s["tp"][1] == s["tp_mixed"]
    for tp in s["tp"]:
        assert_server_cpu_plausible(tp["server_cpu"])
    assert set(s["tp_load"]["server_cpu"]["requests_by_op"]) <= {"retrieve", "stats"}
    # the ranks load one prefix into one block table: all but the first share its plan
    plans = s["tp_load"]["server_cpu"]["retrieve_plans"]
    assert plans.get("reused", 0) > plans.get("planned", 0), plans
    assert_server_cpu_plausible(s["phase2"]["server_cpu"])
    p2, l1 = s["phase2"], s["l1"]
    assert p2["errors"] == 0 and p2["mismatched_bytes"] == 0 and p2["checked_bytes"] > 0
    assert p2["store_gbps"] > 0 and p2["retrieve_gbps"] > 0 and p2["ranks_reporting"] == 3
    assert l1["copied_bytes_phase2"] == l1["distinct_bytes_phase2"] > 0
    if l1["evicted_bytes_phase2"] == 0:
        assert (
            l1["used_bytes"] == l1["single_copy_bytes"] >= (8 * chunk + l1["distinct_bytes_phase2"])
        )
    assert s["raw"]["d2h_gbps"] > 0 and s["raw"]["processes"] == 4
    p3 = s["phase3"]
    assert p3["victim_rank"] == 3 and p3["registrations_after"] == 3
    assert p3["detected_s"] is not None and p3["detected_s"] <= 5
    alive = {row["rank"]: row["alive"] for row in r["rows"]}
    assert alive == {0: True, 1: True, 2: True, 3: False}
    assert s["registrations_at_end"] == 0
    pids = {f"lmc-{row['pid']}-" for row in r["rows"]}  # the killed rank's too
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(tuple(pids))]


def test_ranks_tp_grid_runs_every_pair_on_one_server(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    res = CliRunner().invoke(
        bench,
        [
            "ranks",
            "--ranks",
            "2",
            "--chunks",
            "4",
            "--batch",
            "2",
            "--duration-s",
            "0.5",
            "--no-kill-one",
            "--layers",
            "2",
            "--raw-s",
            "0.05",
            "--l1-size-gb",
            "0.5",
            "--tp-modes",
            "load",
            "--tp-s",
            "0.5",
            "--tp-chunks",
            "1,3",
            "--tp-inflight",
            "2",
            "--json",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["config"]["tp_chunks"] == [1, 3] and r["config"]["tp_inflight"] == [2]
    s = r["summary"]
    assert s["ok"] and all(s["checks"].values()), s["checks"]
    assert [(t["mode"], t["chunks"], t["inflight"]) for t in s["tp"]] == [
        ("load", 1, 2),
        ("load", 3, 2),
    ]
    assert "tp_load" not in s  # a grid has no one TP entry per mode
    for tp in s["tp"]:
        assert tp["errors"] == 0 and tp["mismatched_bytes"] == 0 and tp["checked_bytes"] > 0
        assert tp["retrieve_gbps"] > 0
        assert_server_cpu_plausible(tp["server_cpu"])
    assert_server_cpu_plausible(s["phase2"]["server_cpu"])
    # the table: a row per TP pair and one for phase 2
    rows = [
        line.split()
        for line in res.output.splitlines()
        if line.strip().startswith(("tp load", "phase 2"))
    ]
    assert [row[:4] for row in rows] == [
        ["tp", "load", "1", "2"],
        ["tp", "load", "3", "2"],
        ["phase", "2", "2", "-"],
    ]


def test_ranks_refuses_tp_chunks_beyond_what_phase_1_stores() -> None:
    res = CliRunner().invoke(
        bench, ["ranks", "--chunks", "8", "--tp-chunks", "4,9", "--layers", "2"]
    )
    assert res.exit_code == 2
    assert "--tp-chunks 9" in res.output and "--chunks 9 or more" in res.output
    res = CliRunner().invoke(bench, ["ranks", "--tp-inflight", "1,65", "--layers", "2"])
    assert res.exit_code == 2 and "--tp-inflight" in res.output
