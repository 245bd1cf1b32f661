"""``lmcache bench l2`` runs end to end on a tiny geometry and reports clean bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmc_server.l2.redisproc import redis_server_path

if redis_server_path() is None:
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true but redis-server is not installed (.ci/install-redis.sh)",
                    pytrace=False)
    pytestmark = pytest.mark.skip(reason="redis-server is not installed")


def test_bench_l2_smoke(tmp_path: Path) -> None:
    out = tmp_path / "l2.json"
    res = subprocess.run(
        [sys.executable, "-m", "lmc_server", "bench", "l2", "--chunks", "2", "--rounds", "1",
         "--latency-chunks", "1,2", "--repeats", "1", "--layers", "4", "--l1-size-gb",
         "0.25", "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert report["summary"]["mismatched_groups"] == 0 and report["summary"]["retrieved_ok"]
    ops = [r["op"] for r in report["rows"]]
    assert ops == ["write 2 chunks", "read 2 chunks", "L2 hit 1 chunks", "L2 hit 2 chunks"]
    for r in report["rows"]:
        assert r["server_s"] > 0 and r["raw_s"] > 0
        assert abs(r["ratio"] - r["raw_s"] / r["server_s"]) < 1e-9
    assert report["summary"]["l2_b"]["hits"] >= 2 and not report["summary"]["l2_b"]["invalid"]
