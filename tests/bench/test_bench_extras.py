"""``lmcache bench`` on the base install: the optional packages (tqdm and matplotlib of
the bench extra, redis-py of the l2 extra) are needed only where they are used, and a
missing one is a one-line usage error (exit 2) naming the pip command, never a traceback.

"Not installed" is a folder on ``PYTHONPATH`` whose ``redis.py``, ``tqdm.py`` and
``matplotlib.py`` raise ``ModuleNotFoundError`` as a missing package does; the servers
the benchmarks start inherit it, so nothing in the run may import them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MISSING = ("redis", "tqdm", "matplotlib")


@pytest.fixture
def bare_env(tmp_path: Path) -> dict[str, str]:
    block = tmp_path / "not-installed"
    block.mkdir()
    for name in MISSING:
        (block / f"{name}.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(block), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """Three conversations of two turns, each turn reusing its conversation's prefix."""
    path = tmp_path / "trace.jsonl"
    lines = [
        json.dumps(
            {
                "timestamp": turn * 1000 + conv,
                "input_length": 512 * turn,
                "hash_ids": [1000 * conv + k for k in range(turn)],
            }
        )
        for turn in (1, 2)
        for conv in range(3)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def bench(
    env: dict[str, str], *args: str, stderr: int | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmc_server", "bench", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr is None else stderr,
        text=True,
        timeout=120,
    )


def assert_names_the_extra(res: subprocess.CompletedProcess[str], text: str, extra: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, res.stderr
    assert text in errors[0] and f"pip install 'lmc-server[{extra}]'" in errors[0], errors[0]


def test_disk_tier_replay_needs_neither_redis_nor_tqdm(
    bare_env: dict[str, str], trace: Path
) -> None:
    res = bench(bare_env, "l2", "--replay", str(trace), "--replay-tier", "disk", "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "L1 + disk" in res.stdout and "L1 only" in res.stdout


def test_throughput_with_no_progress_needs_no_tqdm(bare_env: dict[str, str]) -> None:
    res = bench(
        bare_env,
        "throughput",
        "--layers",
        "2",
        "--batches",
        "1",
        "--min-time-s",
        "0.01",
        "--min-iters",
        "1",
        "--l1-size-gb",
        "0.25",
        "--no-progress",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 mismatched bytes" in res.stdout


def test_progress_bar_on_a_terminal_without_tqdm_names_the_bench_extra(
    bare_env: dict[str, str],
) -> None:
    """A bar is drawn only on a terminal, so only there is tqdm needed."""
    main, sub = os.openpty()
    try:
        res = bench(bare_env, "latency", "--duration-s", "0.01", stderr=sub)
        os.close(sub)
        sub = -1
        out = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # EIO once the other end is closed and drained
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
        if sub >= 0:
            os.close(sub)
    res.stderr = out.decode().replace("\r\n", "\n")
    assert_names_the_extra(res, "progress bar needs the tqdm package", "bench")
    assert "--no-progress" in res.stderr


def test_plot_without_matplotlib_names_the_bench_extra(
    bare_env: dict[str, str], tmp_path: Path
) -> None:
    res = bench(bare_env, "latency", "--plot", str(tmp_path / "p.png"), "--no-progress")
    assert_names_the_extra(res, "--plot needs the matplotlib package", "bench")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    "args",
    [["--replay", "TRACE"], ["--replay", "TRACE", "--replay-tier", "l2"], []],
    ids=["replay", "replay-l2", "throughput"],
)
def test_redis_tier_without_redis_names_the_l2_extra(
    bare_env: dict[str, str], trace: Path, args: list[str]
) -> None:
    args = [str(trace) if a == "TRACE" else a for a in args]
    res = bench(bare_env, "l2", *args, "--no-progress")
    assert_names_the_extra(res, "needs the redis package", "l2")
