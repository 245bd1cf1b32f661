"""``lmcache bench l2`` runs end to end on a tiny geometry and reports clean bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmc_server.testing.bench_runs import run_bench_l2
from lmc_server.testing.redis_process import RedisProcess, redis_server_path

if redis_server_path() is None:
    if os.environ.get("CI") == "true":
        pytest.fail(
            "CI=true but redis-server is not installed (.ci/install-redis.sh)", pytrace=False
        )
    pytestmark = pytest.mark.skip(reason="redis-server is not installed")


def test_bench_l2_smoke(tmp_path: Path) -> None:
    out = tmp_path / "l2.json"
    report, _ = run_bench_l2(out, "--warm-store-gb", "0.01")
    assert report["config"]["warm_store_gb"] == 0.01 and report["config"]["warm_store_s"] > 0
    assert report["summary"]["mismatched_groups"] == 0 and report["summary"]["retrieved_ok"]
    ops = [r["op"] for r in report["rows"]]
    assert ops == ["write 2 chunks", "read 2 chunks", "L2 hit 1 chunks", "L2 hit 2 chunks"]
    for r in report["rows"]:
        assert r["server_s"] > 0 and r["raw_s"] > 0
        assert abs(r["ratio"] - r["raw_s"] / r["server_s"]) < 1e-9
    assert report["summary"]["l2_b"]["hits"] >= 2 and not report["summary"]["l2_b"]["invalid"]


def test_bench_l2_replay_smoke(tmp_path: Path) -> None:
    """Tier hit ratios on a tiny trace: ten conversations take turns, each turn reusing
    its conversation's prefix; an L1 of one slab (16 chunks) cannot keep them, the L2
    can."""
    trace = tmp_path / "trace.jsonl"
    lines = []
    for turn in range(1, 5):  # each turn grows its conversation by one 512-token block
        for conv in range(10):
            lines.append(
                json.dumps(
                    {
                        "timestamp": turn * 1000 + conv,
                        "input_length": 512 * turn,
                        "hash_ids": [1000 * conv + k for k in range(turn)],
                    }
                )
            )
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "replay.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmc_server",
            "bench",
            "l2",
            "--replay",
            str(trace),
            "--l1-fraction",
            "0.01",
            "--l2-fraction",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    rows = {r["tier"]: r for r in report["rows"]}
    inf = report["summary"]["infinite_ratio"]
    assert inf > 0.5
    for r in rows.values():
        assert r["hit_ratio"] <= inf + 1e-9
        assert abs(r["hit_ratio"] - r["l1_hit_ratio"] - r["l2_hit_ratio"]) < 1e-9
    assert rows["L1 only"]["l2_hit_ratio"] == 0
    assert rows["L1 + L2"]["l2_invalid"] == 0
    assert rows["L1 + L2"]["l2_hit_ratio"] > 0


def test_redis_io_threads_start_a_threaded_redis_and_refuse_a_given_url() -> None:
    """``--redis-io-threads N`` reaches the redis-server the bench starts; with
    ``--redis-url`` (a store it does not start) it is refused before anything runs, and
    so is ``--warm-store-gb`` (it would flush a store that is not the bench's): the
    store's keys are still there."""
    with RedisProcess(io_threads=3) as r, r.client() as c:
        assert c.config_get("io-threads") == {"io-threads": "3"}
        assert c.config_get("io-threads-do-reads") == {"io-threads-do-reads": "yes"}
        c.set(b"users-key", b"kept")
        for flag, value in (("--redis-io-threads", "4"), ("--warm-store-gb", "1")):
            res = subprocess.run(
                [sys.executable, "-m", "lmc_server", "bench", "l2", flag, value]
                + ["--redis-url", r.url],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert res.returncode == 2 and flag in res.stderr, res.stderr
        assert c.get(b"users-key") == b"kept"


def test_redis_adapter_micro_moves_the_bytes_back(tmp_path: Path) -> None:
    """``bench.micro.redis_adapter`` writes, reads back and compares (it fails on a
    difference), and reports a rate per connection count."""
    out = tmp_path / "adapter.json"
    res = subprocess.run(
        [sys.executable, "-m", "lmc_server.bench.micro.redis_adapter", "--connections", "1,3"]
        + ["--objects", "5", "--object-bytes", "300000", "--rounds", "2"]
        + ["--warm-store-gb", "0.002", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert [r["connections"] for r in report["rows"]] == [1, 3]
    for r in report["rows"]:
        assert r["write_gbps"] > 0 and r["read_gbps"] > 0
        assert len(r["write_gbps_rounds"]) == len(r["read_gbps_rounds"]) == 2
    assert report["warm_store_s"] > 0 and report["store"]
