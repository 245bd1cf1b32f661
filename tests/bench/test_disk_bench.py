"""``lmcache bench l2 --disk-dir`` and ``--replay-tier disk`` run end to end on tiny
inputs and report clean bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lmc_server.testing.bench_runs import run_bench_l2


def test_bench_l2_disk_smoke(tmp_path: Path) -> None:
    out = tmp_path / "disk.json"
    report, stdout = run_bench_l2(
        out, "--disk-dir", str(tmp_path / "d"), "--restart-gb", "0.02", "--flood-chunks", "8"
    )
    assert report["summary"]["mismatched_groups"] == 0 and report["summary"]["retrieved_ok"]
    assert [r["op"] for r in report["rows"]] == [
        "write 2 chunks",
        "write-behind 2 chunks",
        "read 2 chunks",
        "disk hit 1 chunks",
        "disk hit 2 chunks",
    ]
    for r in report["rows"]:
        assert r["server_s"] > 0 and r["raw_s"] > 0
    assert not report["summary"]["disk_b"]["invalid"]
    restart = report["summary"]["restart"]
    assert restart["files"] > 0 and restart["ping_to_first_hit_s"] > 0
    assert "restart on" in stdout
    flood = report["summary"]["flood"]
    for f in flood.values():  # every committed object written or dropped, by cause
        assert f["committed_objects"] == 8 * 2
        assert f["written_objects"] + sum(f["dropped_writes"].values()) == 16
    assert flood["paced"]["store_gbps_target"] > 0 and "flood paced" in stdout


def test_bench_l2_replay_disk_smoke(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = []
    for turn in range(1, 5):
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
            "--replay-tier",
            "disk",
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
    rows = {r["tier"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        "L1 only",
        "L1 + disk",
        "model: disk at commit",
        "model: disk at evict",
        "model: disk at hit",
    }
    assert rows["L1 + disk"]["l2_hit_ratio"] > 0 and rows["L1 + disk"]["l2_invalid"] == 0
    assert rows["model: disk at commit"]["l2_hit_ratio"] > 0
