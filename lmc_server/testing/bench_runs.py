"""``lmcache bench l2`` run as a command on tiny inputs, for the tiers' smoke tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_bench_l2(
    out: Path, *extra: str, latency_chunks: str = "1,2", timeout_s: float = 180
) -> tuple[dict[str, Any], str]:
    """Run ``python -m lmc_server bench l2`` on 2 chunks of a 4-layer preset (one round,
    one repeat, a 0.25 GiB L1) plus ``extra``; the JSON report and the printed output.
    A non-zero exit fails with everything the command printed."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmc_server",
            "bench",
            "l2",
            *extra,
            "--chunks",
            "2",
            "--rounds",
            "1",
            "--latency-chunks",
            latency_chunks,
            "--repeats",
            "1",
            "--layers",
            "4",
            "--l1-size-gb",
            "0.25",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(out.read_text()), res.stdout
