"""What a server says of its pool size at start, and what it leaves behind at a clean
stop: an ``--l1-size-gb`` is logged as given and in GiB, its rounding down to whole
slabs said once; the ``--ipc-path`` and KV-event ``ipc://`` socket files are removed
after SIGTERM (and only the files this server bound)."""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path

from lmc_server.client import Client
from lmc_server.server.security import remove_ipc
from lmc_server.testing.process import ServerProcess


def test_a_size_between_slabs_is_logged_readably_and_its_rounding_said_once() -> None:
    with ServerProcess(l1_size_gb=0.3) as srv:
        assert srv.terminate(signal.SIGTERM) == 0
        log = srv.log()
    starting = next(line for line in log.splitlines() if " starting: " in line)
    assert re.search(r" l1_size_gb=0\.3 ", starting), starting
    rounded = [line for line in log.splitlines() if "rounded down" in line]
    assert len(rounded) == 1, log
    assert "L1 size 0.30 GiB rounded down to whole slabs of 64 MiB: 0.25 GiB" in rounded[0]
    assert "L1 0.25 GiB = 4 slabs of 64 MiB" in log


def test_a_whole_number_of_slabs_is_not_said_to_be_rounded() -> None:
    with ServerProcess(l1_size_gb=0.25) as srv:
        assert srv.terminate(signal.SIGTERM) == 0
        log = srv.log()
    assert "rounded down" not in log and "L1 0.25 GiB = 4 slabs of 64 MiB" in log
    assert re.search(r" l1_size_gb=0\.25 ", log)


def test_the_ipc_socket_file_is_removed_after_sigterm(tmp_path: Path) -> None:
    path = tmp_path / "run" / "lmcache.sock"
    with ServerProcess(["--ipc-path", str(path)]) as srv:
        with Client(f"ipc://{path}", timeout_s=10) as c:
            assert c.ping().server_version
        assert path.is_socket()
        assert srv.terminate(signal.SIGTERM) == 0
    assert not path.exists(), "the socket file outlived the server"
    assert path.parent.is_dir(), "the folder stays (it may be the operator's)"


def test_the_kv_event_ipc_socket_files_are_removed_after_sigterm(tmp_path: Path) -> None:
    events, replay = tmp_path / "events", tmp_path / "replay"
    args = ["--kv-events-endpoint", f"ipc://{events}", "--kv-events-replay-endpoint"]
    with ServerProcess([*args, f"ipc://{replay}"]) as srv:
        assert events.is_socket() and replay.is_socket()
        assert srv.terminate(signal.SIGTERM) == 0
    assert not events.exists() and not replay.exists()


def test_only_the_socket_file_this_server_bound_is_removed(tmp_path: Path) -> None:
    """A server started later at the same path replaced the file: it is not ours."""
    path = tmp_path / "lmcache.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        inode = os.lstat(path).st_ino
        remove_ipc(str(path), inode + 1)
        assert path.is_socket()
        remove_ipc(str(path), inode)
        assert not path.exists()
    path.write_text("not a socket")
    remove_ipc(str(path), os.lstat(path).st_ino)
    assert path.read_text() == "not a socket"
