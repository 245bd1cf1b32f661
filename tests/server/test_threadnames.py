"""The server's threads carry OS names, so per-thread CPU can be read by name.

``top -H``, ``ps -L`` and ``/proc/<pid>/task/<tid>/comm`` show the kernel's name of a
thread, which Python does not set from ``threading.Thread.name``. The function on its
own first (a thread names itself, a long name is cut on a character boundary, the main
thread keeps the process name), then a real CPU-backend server process: after a store
large enough for the copy threads, its copy threads, its metrics thread and zmq's I/O
threads are there by name, and the event loop (the thread whose tid is the pid) still
carries the process name.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess, free_port
from lmc_server.threadnames import MAX_NAME_BYTES, name_os_thread, os_name
from lmc_server.transfer.cpu import INLINE_BYTES

#: numpy's BLAS starts its own threads at import (one per core, named as the process):
#: not the server's, so the server under test runs without them.
NO_BLAS_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def comm(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().rstrip("\n")


def thread_names(pid: int) -> dict[int, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = comm(pid, int(task.name))
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between listing and reading (ENOENT or ESRCH)
    return out


def _in_thread(name: str | None, thread_name: str = "probe") -> str:
    """The OS name a new thread has after ``name_os_thread(name)``."""
    seen: list[str] = []

    def run() -> None:
        name_os_thread(name)
        seen.append(comm(os.getpid(), threading.get_native_id()))

    t = threading.Thread(target=run, name=thread_name)
    t.start()
    t.join()
    return seen[0]


def test_a_thread_gets_its_threading_name_or_the_one_given() -> None:
    assert _in_thread(None, "lmc-probe_0") == "lmc-probe_0"
    assert _in_thread("lmc-cuda0-wait") == "lmc-cuda0-wait"


def test_a_long_name_is_cut_to_what_the_kernel_keeps_on_a_character_boundary() -> None:
    assert _in_thread("lmc-a-very-long-thread-name") == "lmc-a-very-long"
    name = "lmc-" + "é" * 10  # 4 + 20 bytes: 15 would split the sixth é
    assert os_name(name) == ("lmc-" + "é" * 5).encode()
    assert len(os_name(name)) <= MAX_NAME_BYTES
    assert _in_thread(name) == "lmc-" + "é" * 5


def test_the_main_thread_keeps_the_process_name() -> None:
    before = comm(os.getpid(), os.getpid())
    assert threading.current_thread() is threading.main_thread()
    name_os_thread("lmc-not-me")
    assert comm(os.getpid(), os.getpid()) == before


def test_a_server_process_names_its_copy_metrics_and_zmq_threads() -> None:
    copy_threads = 2
    metrics = free_port()
    geo = simple_model(num_blocks=64, layers=4, bytes_per_token=1024)
    with (
        ServerProcess(
            ["--copy-threads", str(copy_threads)], metrics_port=metrics, env=NO_BLAS_THREADS
        ) as srv,
        Client(srv.endpoint) as c,
        ShmKV(geo) as kv,
    ):
        assert srv.proc is not None
        pid = srv.proc.pid
        kv.fill_random(5)
        reg = c.register(**kv.register_kwargs())
        n_chunks = 4
        assert n_chunks * reg.chunk_bytes > INLINE_BYTES  # split over the copy threads
        digests = chunk_digests(np.arange(n_chunks * 256), 256)
        assert c.store(reg, digests, block_ids_for(reg, n_chunks)).ok.all()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            assert r.status == 200
        names = thread_names(pid)
        process_name = Path(f"/proc/{pid}/comm").read_text().rstrip("\n")
        assert names[pid] == process_name and not process_name.startswith("lmc-"), names
        copies = sorted(n for n in names.values() if n.startswith("lmc-copy_"))
        assert copies and set(copies) <= {f"lmc-copy_{i}" for i in range(copy_threads)}, names
        assert "lmc-metrics" in names.values(), names
        assert any(n.startswith("ZMQbg/") for n in names.values()), names
        # a thread the server started and did not name shows the process name
        deadline = time.monotonic() + 5  # a scrape's thread ends after its answer
        while True:
            unnamed = [t for t, n in thread_names(pid).items() if n == process_name and t != pid]
            if not unnamed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert unnamed == [], thread_names(pid)
