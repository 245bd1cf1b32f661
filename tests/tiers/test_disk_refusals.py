"""A disk directory the server cannot use is refused at start, saying what to change.

Real ``lmcache server`` processes: each unusable ``--disk-dir`` (a path under a file,
a kernel filesystem, a directory the server's user cannot write) exits with status 2
and one line naming the path, the errno and the fix (ownership, mode, the unit's
``ReadWritePaths=``), and creates nothing. With ``--disk-optional`` the same server
starts, says why the disk tier is degraded, and serves L1 byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmc_server.client import chunk_digests
from lmc_server.testing.process import ServerProcess, free_port
from lmc_server.testing.tierworker import (
    BASE_ARGS,
    CHUNK,
    Worker,
    disk_stats,
    retrieve_exact,
    tokens,
    wait_for,
)


def start(disk_dir: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "lmc_server",
            "server",
            "--backend",
            "cpu",
            "--l1-size-gb",
            "0.25",
            "--port",
            str(free_port()),
            "--metrics-port",
            "0",
            "--disk-dir",
            disk_dir,
            "--disk-size-gb",
            "0.01",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_refused(out: subprocess.CompletedProcess[str], path: str, *words: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert f"--disk-dir {path}:" in line, line
    for w in (*words, "--disk-optional"):
        assert w in line, (w, line)


def test_a_path_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / "file" / "disk")
    assert_refused(start(path), path, "ENOTDIR", "is a file")


def test_a_kernel_filesystem_is_refused() -> None:
    assert_refused(start("/proc/lmc-disk"), "/proc/lmc-disk", "ENOENT", "use a directory")
    assert not os.path.exists("/proc/lmc-disk")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the mode says")
def test_a_directory_the_user_cannot_write_is_refused_with_the_unit_fix(tmp_path: Path) -> None:
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    try:
        assert_refused(start(str(d)), str(d), "EACCES", "chown", "ReadWritePaths=")
        assert list(d.iterdir()) == []
    finally:
        d.chmod(0o700)


def test_disk_optional_starts_degraded_and_l1_serves(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / "file" / "disk")
    with ServerProcess(
        [*BASE_ARGS, "--disk-dir", path, "--disk-size-gb", "0.01", "--disk-optional"]
    ) as a:
        src, dst = Worker(a.endpoint, seed=5), Worker(a.endpoint, seed=0)
        try:
            st = disk_stats(src.client)
            assert st.state == "degraded" and "ENOTDIR" in st.reason, st.reason
            d = chunk_digests(tokens(77, 3), CHUNK)
            ids = src.store(d, block_seed=1)
            retrieve_exact(dst, src, ids, d, 3)
            wait_for(lambda: "ENOTDIR" in a.log(), "the degraded tier in the log")
            assert "Traceback" not in a.log()
        finally:
            src.close()
            dst.close()
