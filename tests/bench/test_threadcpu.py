"""Per-thread CPU from /proc (``lmc_server.bench.threadcpu``), the benchmarks' saturation
reading.

The arithmetic on made-up snapshots first (groups, the busiest thread, a thread that
started inside the window, the saturation rate and its cap), then the reader on this
process: a thread that burns CPU under a name shows up under that name with about the
CPU it burnt, and a child process is read with its parent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmc_server.bench.threadcpu import (
    TICK_S,
    Snapshot,
    ThreadTime,
    _stat,
    cpu_report,
    group_of,
    process_tree,
    snapshot,
)
from lmc_server.threadnames import name_os_thread

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")

PID = 100


def _snap(t_s: float, threads: dict[int, tuple[str, int]]) -> Snapshot:
    snap = Snapshot(t_s)
    for tid, (name, ticks) in threads.items():
        snap.threads[(PID, tid)] = ThreadTime(PID, tid, name, ticks)
    snap.processes[PID] = ("lmcache", sum(t for _, t in threads.values()))
    return snap


def test_threads_are_grouped_by_name_and_the_main_thread_is_the_loop() -> None:
    assert group_of(7, 7, "python") == "loop"
    assert group_of(7, 7, "lmc-copy_0") == "loop"  # tid == pid, whatever its name
    assert group_of(7, 8, "lmc-copy_3") == "copy_threads"
    assert group_of(7, 8, "lmc-cuda0-wait") == "copy_waiters"
    assert group_of(7, 8, "ZMQbg/IO/0") == "zmq_io"
    assert group_of(7, 8, "cuda-EvtHandlr") == "cuda"
    assert group_of(7, 8, "lmc-redis-r_1") == "tiers"
    assert group_of(7, 8, "lmc-disk_0") == "tiers"
    assert group_of(7, 8, "lmc-gpu1-busy") == "gpu_sampler"
    assert group_of(7, 8, "python") == "other"


def test_a_stat_line_whose_name_holds_spaces_and_parentheses(tmp_path: Path) -> None:
    fields = ["S"] + ["0"] * 10 + ["123", "45"] + ["0"] * 30  # utime, stime: fields 14, 15
    path = tmp_path / "stat"
    path.write_text(f"4242 (a (b) c) {' '.join(fields)}\n")
    assert _stat(path) == ("a (b) c", 168)
    assert _stat(tmp_path / "gone") is None


def test_cpu_per_request_busy_fractions_and_the_saturation_rate() -> None:
    ticks_per_s = round(1 / TICK_S)
    a = _snap(10.0, {PID: ("lmcache", 0), 101: ("ZMQbg/IO/0", 5), 102: ("lmc-copy_0", 0)})
    # 2 s later, 1000 requests: the loop 1.5 s busy, zmq 0.2 s, a copy thread that
    # started inside the window 0.4 s, and one that ended (in the process total only)
    b = _snap(
        12.0,
        {
            PID: ("lmcache", int(1.5 * ticks_per_s)),
            101: ("ZMQbg/IO/0", 5 + int(0.2 * ticks_per_s)),
            102: ("lmc-copy_0", int(0.1 * ticks_per_s)),
            103: ("lmc-copy_1", int(0.4 * ticks_per_s)),
        },
    )
    b.processes[PID] = ("lmcache", b.processes[PID][1] + ticks_per_s)
    r = cpu_report(a, b, requests=1000)
    assert r["wall_s"] == 2.0 and r["requests_per_s"] == 500.0
    g = r["groups"]
    assert list(g) == ["loop", "copy_threads", "zmq_io"]  # GROUP_NAMES order
    assert g["loop"] == pytest.approx(
        {"threads": 1, "cpu_s": 1.5, "cpu_us_per_request": 1500.0, "busy": 0.75}
    )
    assert g["copy_threads"]["threads"] == 2 and g["copy_threads"]["cpu_s"] == pytest.approx(0.5)
    assert g["zmq_io"]["busy"] == pytest.approx(0.1)
    busiest = r["busiest_thread"]
    assert (busiest["tid"], busiest["group"], busiest["busy"]) == (PID, "loop", 0.75)
    # 500 req/s with the loop 75% busy: it would be saturated at 667 req/s
    assert r["saturation_requests_per_s"] == pytest.approx(500 / 0.75)
    assert r["loop_saturation_requests_per_s"] == r["saturation_requests_per_s"]
    (proc,) = r["processes"]
    assert proc["cpu_s"] == pytest.approx(1.5 + 0.2 + 0.5 + 1.0)  # the ended thread too


def test_the_python_threads_share_one_gil_and_bound_the_rate_lower() -> None:
    """The loop 0.5 s and two copy waiters 0.3 s each of a 1 s window: no one thread is
    saturated, but together they hold the GIL 1.1 s of 1 s; ZMQ's, CUDA's and the cpu
    engine's copy threads do not count."""
    ticks_per_s = round(1 / TICK_S)
    names = {
        PID: "lmcache",
        101: "lmc-cuda0-wait",
        102: "lmc-cuda0-wait",
        103: "ZMQbg/IO/0",
        104: "cuda-EvtHandlr",
        105: "lmc-copy_0",
    }
    a = _snap(0.0, {tid: (n, 0) for tid, n in names.items()})
    cpu = {PID: 0.5, 101: 0.3, 102: 0.3, 103: 0.9, 104: 0.9, 105: 0.9}
    b = _snap(1.0, {tid: (n, int(cpu[tid] * ticks_per_s)) for tid, n in names.items()})
    r = cpu_report(a, b, requests=400)
    assert r["gil_busy"] == pytest.approx(1.1)
    assert r["loop_saturation_requests_per_s"] == pytest.approx(800.0)
    assert r["gil_saturation_requests_per_s"] == pytest.approx(400.0)  # capped at 100 %
    half = _snap(1.0, {tid: (n, int(cpu[tid] * ticks_per_s / 2)) for tid, n in names.items()})
    r = cpu_report(a, half, requests=400)
    assert r["gil_busy"] == pytest.approx(0.55)
    assert r["gil_saturation_requests_per_s"] == pytest.approx(400 / 0.55)
    assert r["gil_saturation_requests_per_s"] < r["loop_saturation_requests_per_s"]


def test_the_saturation_rate_never_falls_below_the_rate_measured() -> None:
    """A thread read at 102% busy (the windows' ends rounded to ticks) counts as 100%."""
    ticks_per_s = round(1 / TICK_S)
    a = _snap(0.0, {PID: ("lmcache", 0)})
    b = _snap(1.0, {PID: ("lmcache", int(1.02 * ticks_per_s))})
    r = cpu_report(a, b, requests=300)
    assert r["busiest_thread"]["busy"] > 1
    assert r["saturation_requests_per_s"] == pytest.approx(300.0)


def test_no_requests_and_no_cpu_give_no_rates() -> None:
    a = _snap(0.0, {PID: ("lmcache", 10)})
    r = cpu_report(a, _snap(1.0, {PID: ("lmcache", 10)}), requests=0)
    assert r["groups"]["loop"]["cpu_us_per_request"] is None
    assert r["saturation_requests_per_s"] is None
    assert r["gil_saturation_requests_per_s"] is None


def test_a_named_busy_thread_of_this_process_is_read_with_its_cpu() -> None:
    stop = threading.Event()
    started = threading.Event()

    def spin() -> None:
        name_os_thread("lmc-copy_9")
        started.set()
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    started.wait()
    try:
        a = snapshot(os.getpid())
        time.sleep(0.5)
        b = snapshot(os.getpid())
    finally:
        stop.set()
        t.join()
    r = cpu_report(a, b, requests=10)
    copy = r["groups"]["copy_threads"]
    # one thread: at most one core's worth, less the GIL it shares with this one; the
    # bound leaves room for the clock-tick reads at both ends and for the time a loaded
    # machine takes between a snapshot's wall stamp and its /proc reads (1.125 seen
    # under load), while a report that summed threads or counted one twice (2.0) fails
    assert copy["threads"] == 1 and 0.05 < copy["busy"] <= 1.5, r
    assert (os.getpid(), os.getpid()) in b.threads  # the main thread: "loop"


def test_a_child_process_is_read_with_its_parent() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in process_tree(os.getpid()):
            assert time.monotonic() < deadline, "child not found under /proc/*/task/*/children"
            time.sleep(0.01)
        assert child.pid in snapshot(os.getpid()).processes
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_reads_as_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    a = snapshot(child.pid)
    assert a.threads == {} and a.processes == {}
    r = cpu_report(a, snapshot(child.pid), requests=5)
    assert r["groups"] == {} and r["busiest_thread"] is None and r["processes"] == []
    assert r["saturation_requests_per_s"] is None
