"""Synthetic traces and the replay table: every policy against a real server."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from lmc_server.bench.cli import bench
from lmc_server.bench.micro.policy_ops import run_one
from lmc_server.bench.traces.generate import GENERATORS, multi_turn, shared_prompts, write
from lmc_server.bench.traces.trace import chunk_ids, load_trace
from lmc_server.cache.eviction.registry import POLICIES


def test_generators_are_deterministic_and_load_as_traces(tmp_path: Path) -> None:
    for name in GENERATORS:
        a, b = tmp_path / f"{name}-a.jsonl", tmp_path / f"{name}-b.jsonl"
        assert write(name, str(a), 200) == 200
        write(name, str(b), 200)
        assert a.read_bytes() == b.read_bytes()
        reqs = load_trace(str(a))
        assert len(reqs) == 200
        assert [r.timestamp_ms for r in reqs] == sorted(r.timestamp_ms for r in reqs)
        for line, r in zip(a.read_text().splitlines(), reqs, strict=True):
            assert r.n_chunks == 2 * len(json.loads(line)["hash_ids"])  # whole blocks


def test_multi_turn_prompts_extend_their_previous_turn() -> None:
    recs = list(multi_turn(requests=2000))
    seen = set()
    extends = 0
    for r in recs:
        ids = tuple(r.hash_ids)
        extends += any(ids[:k] in seen for k in range(len(ids) - 1, 0, -1))
        seen.add(ids)
    # sessions last 6 turns on average: most requests extend an earlier prompt
    assert extends > 0.7 * len(recs)


def test_shared_prompts_share_heads_and_scan_one_off_documents() -> None:
    recs = list(shared_prompts(requests=2000))
    heads: dict[int, int] = {}
    for r in recs:
        heads[r.hash_ids[0]] = heads.get(r.hash_ids[0], 0) + 1
    shared = sum(n for n in heads.values() if n > 1)
    one_off = sum(1 for n in heads.values() if n == 1)
    assert 0.5 * len(recs) < shared < 0.85 * len(recs)  # ~70% behind shared prompts
    assert one_off > 0.15 * len(recs)


def test_replay_table_has_every_policy_and_the_actual_fraction(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write("multi-turn", str(trace), 300)
    _, distinct = chunk_ids(load_trace(str(trace)))
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(
        bench,
        [
            "replay",
            "--trace",
            str(trace),
            "--layers",
            "2",
            "--slab-size-mb",
            "1",
            "--fractions",
            "0.05,0.3",
            "--json",
            str(out),
            "--plot",
            str(plot),
            "--no-progress",
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header = next(line for line in res.output.splitlines() if "requested" in line)
    assert header.split() == [
        "requested",
        "actual",
        "L1",
        "GiB",
        "objects",
        *POLICIES,
        "Belady",
        "infinite",
    ]
    report = json.loads(out.read_text())
    assert {r["policy"] for r in report["rows"]} == set(POLICIES)
    for r in report["rows"]:
        assert r["actual_fraction"] == r["capacity_objects"] / distinct
        assert r["actual_fraction"] <= r["fraction"]
        assert r["capacity_objects"] == r["server_capacity_objects"]
        assert 0 <= r["hit_ratio"] <= r["belady_ratio"] + 1e-12
    for r in report["rows"]:  # the printed line shows the actual fraction
        assert f"{r['actual_fraction']:.4f}" in res.output


def test_policy_ops_bench_runs_every_policy() -> None:
    for name in POLICIES:
        assert 0 < run_one(name, 500, 3000) < 1e-3
