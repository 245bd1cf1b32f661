"""Smoke tests of ``lmcache bench``: every subcommand runs for a few seconds on CPU
against real server processes and writes a JSON report whose numbers hang together;
the trace bounds are checked against hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lmc_server.bench.cli import bench
from lmc_server.bench.servers import ThreadServer
from lmc_server.bench.traces.bounds import belady_hits, infinite_hits, next_uses
from lmc_server.bench.traces.trace import load_trace
from lmc_server.client import Client
from lmc_server.config import Config
from lmc_server.testing.process import free_port


def _run(args: list[str], tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "report.json"
    plot = tmp_path / "plot.png"
    res = CliRunner().invoke(
        bench,
        [*args, "--json", str(out), "--plot", str(plot), "--no-progress"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["command"] and report["date"] and report["machine"]["cores"] >= 1
    return report


def test_throughput_cpu(tmp_path: Path) -> None:
    r = _run(
        [
            "throughput",
            "--layers",
            "4",
            "--batches",
            "1,3",
            "--min-time-s",
            "0.05",
            "--min-iters",
            "2",
            "--l1-size-gb",
            "1",
            "--concurrent",
            "--inflight",
            "1,2",
        ],
        tmp_path,
    )
    rows = r["rows"]
    assert {(x["mode"], x["chunks"]) for x in rows} == {
        (m, n)
        for m in (
            "store",
            "retrieve",
            "store+retrieve",
            "store x2",
            "retrieve x2",
            "store+retrieve x2",
        )
        for n in (1, 3)
    }
    chunk = r["config"]["chunk_bytes"]
    for x in rows:
        assert x["mismatched_bytes"] == 0 and x["failed_chunks"] == 0
        assert x["ours_gbps"] > 0 and x["raw_gbps"] > 0 and x["iters"] >= 2
        assert x["ratio"] == pytest.approx(x["ours_gbps"] / x["raw_gbps"])
        if x["mode"] == "store":
            assert x["bytes"] == x["chunks"] * chunk
        if x["mode"] == "store x2":  # sustained: bytes of one request, rate of all
            assert x["bytes"] == x["chunks"] * chunk
            assert x["ours_gbps"] >= x["bytes"] / (x["p50_ms"] / 1e3) / 1e9 / 4
        if x["mode"] == "retrieve":  # window sections only for the last chunk
            assert 0 < x["bytes"] <= x["chunks"] * chunk
    assert r["summary"]["mismatched_bytes"] == 0


def test_latency(tmp_path: Path) -> None:
    r = _run(["latency", "--clients", "1,2", "--duration-s", "0.1"], tmp_path)
    ops = {(x["op"], x["clients"]) for x in r["rows"]}
    assert ops == {
        (op, n)
        for op in ("ping", "lookup-1", "lookup-256", "probe-64x8", "store/retrieve")
        for n in (1, 2)
    }
    by_op = {x["op"]: x for x in r["rows"] if x["clients"] == 1}
    assert by_op["lookup-256"]["request_bytes"] > 256 * 32 > by_op["ping"]["request_bytes"]
    for x in r["rows"]:
        assert x["samples"] > 0 and 0 < x["p50_us"] <= x["p99_us"]
        assert x["p50_ratio"] == pytest.approx(x["p50_us"] / x["echo_p50_us"])
    assert "lookup256_p50_ratio" in r["summary"]
    assert r["summary"]["probe_prompts_s"] == pytest.approx(
        64 * max(x["ops_s"] for x in r["rows"] if x["op"] == "probe-64x8")
    )


def test_startup(tmp_path: Path) -> None:
    r = _run(["startup", "--l1-size-gb", "1", "--repeats", "1"], tmp_path)
    (row,) = r["rows"]
    assert row["slabs"] == 16
    assert 0 < row["ping_s"] <= row["pool_ready_s"] < 60


def _conversation_trace(path: Path) -> list[list[int]]:
    """Four conversations of three turns sharing a system-prompt block (id 0); each
    turn extends its conversation by one block. Returns each request's hash ids."""
    reqs = []
    lines = []
    t = 0
    for turn in range(3):
        for conv in range(4):
            ids = [0] + [100 * conv + k for k in range(1, turn + 2)]
            reqs.append(ids)
            # the last block holds 300 tokens: one full 256-token chunk of it counts
            lines.append(
                json.dumps(
                    {
                        "timestamp": t,
                        "input_length": 512 * len(ids) - 212,
                        "output_length": 1,
                        "hash_ids": ids,
                    }
                )
            )
            t += 10
    path.write_text("\n".join(lines) + "\n")
    return reqs


def test_trace_chunks(tmp_path: Path) -> None:
    p = tmp_path / "trace.jsonl"
    reqs = _conversation_trace(p)
    trace = load_trace(str(p))
    assert [r.n_chunks for r in trace] == [2 * len(ids) - 1 for ids in reqs]
    # same prefix, same digests: turn 2 of conversation 0 starts with turn 1's chunks
    assert trace[4].digests[: 32 * trace[0].n_chunks] == trace[0].digests
    assert trace[1].digests[:64] == trace[0].digests[:64]
    assert trace[1].digests[64:96] != trace[0].digests[64:96]


def test_bounds_by_hand() -> None:
    reqs = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3], [5]]
    assert infinite_hits(reqs) == [0, 2, 0, 3, 1]
    assert next_uses([[1, 2], [1]]) == [2, 3 + 1, 3 + 2]
    assert belady_hits(reqs, 100) == infinite_hits(reqs)
    assert belady_hits(reqs, 0) == [0] * 5
    # two slots: keep 1 and 2 (used next), bypass 3, 4 and the first 5
    assert belady_hits(reqs, 2) == [0, 2, 0, 2, 0]
    # three slots: after request 2, {1, 2, 3} beat 4 (never again); 5 is next used at
    # request 4 but 1, 2, 3 sooner, so 5 is bypassed
    assert belady_hits(reqs, 3) == [0, 2, 0, 3, 0]


def test_replay(tmp_path: Path) -> None:
    p = tmp_path / "trace.jsonl"
    _conversation_trace(p)
    r = _run(
        [
            "replay",
            "--trace",
            str(p),
            "--layers",
            "2",
            "--slab-size-mb",
            "1",
            "--fractions",
            "0.2,1.0",
            "--policies",
            "LRU,FIFO",
        ],
        tmp_path,
    )
    # by hand: turn 1 hits chunks of block 0 (2 chunks) after the first conversation;
    # later turns hit their whole previous request (2 * turn + 1 chunks)
    hits = [0, 2, 2, 2] + [3] * 4 + [5] * 4
    inputs = sum(512 * (t + 2) - 212 for t in range(3)) * 4
    assert r["summary"]["infinite_ratio"] == pytest.approx(sum(hits) * 256 / inputs)
    assert len(r["rows"]) == 4
    for x in r["rows"]:
        assert x["capacity_objects"] == x["server_capacity_objects"] or x["fraction"] == 1.0
        assert 0 <= x["hit_ratio"] <= x["belady_ratio"] + 1e-12
        assert x["belady_ratio"] <= x["infinite_ratio"] + 1e-12
        assert x["server_hit_tokens"] == pytest.approx(x["hit_ratio"] * inputs)
    full = [x for x in r["rows"] if x["fraction"] == 1.0]
    assert all(x["hit_ratio"] == pytest.approx(x["infinite_ratio"]) for x in full)


def test_thread_server_null_backend() -> None:
    """The in-process fallback replay uses for L1 sizes the config check refuses."""
    ts = ThreadServer(
        Config(port=free_port(), backend="null", l1_size_gb=4096, metrics_port=0)
    ).start()
    try:
        with Client(ts.endpoint, timeout_s=10) as c:
            assert c.stats().l1.capacity_bytes == 4096 << 30
    finally:
        ts.stop()
    assert ts.exit_code == 0
