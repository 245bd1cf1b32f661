"""``lmcache bench ranks --mode dp --backend cuda``: engines on GPUs, one server.

Small (3 engines, 2-layer preset, 3 s, the last engine killed halfway), round-robin over
the visible GPUs like the TP mode: the engines share one namespace, load chunks other
engines stored (across GPUs when there are several), and every byte of every load is
right. Speed is not asserted. Run on a GPU machine (``scripts/gpu-check.sh``); skipped
elsewhere, failed when ``LMC_REQUIRE_GPU=1`` finds no GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from lmc_server.bench.cli import bench

pytestmark = pytest.mark.gpu


def test_dp_engines_on_cuda(tmp_path: Path) -> None:
    import torch

    out = tmp_path / "dp.json"
    res = CliRunner().invoke(
        bench,
        [
            "ranks",
            "--mode",
            "dp",
            "--backend",
            "cuda",
            "--ranks",
            "3",
            "--chunks",
            "8",
            "--batch",
            "4",
            "--duration-s",
            "3",
            "--layers",
            "2",
            "--raw-s",
            "0.1",
            "--l1-size-gb",
            "1",
            "--json",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    s, dp = r["summary"], r["summary"]["dp"]
    assert s["ok"] and all(s["checks"].values()), s["checks"]
    assert "world=1;rank=replicated" in r["config"]["namespace"]
    n = torch.cuda.device_count()
    assert r["config"]["devices"] == [e % n for e in range(3)]
    assert dp["cross_engine_chunks"] > 0 and dp["mismatched_bytes"] == 0
    assert dp["verified_loads"] == dp["loads"] > 0 and dp["failed_chunks"] == 0
    assert dp["store_gbps"] > 0 and dp["load_gbps"] > 0
    assert s["registrations_at_end"] == 0
