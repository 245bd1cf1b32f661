"""A process's CPU by thread, read from ``/proc``, and what it says about saturation.

The server does its per-request work on one event loop; beside it run copy threads
(cpu engine), copy waiters (cuda engine), zmq's I/O threads, CUDA's own threads and the
tiers' I/O threads. Which of them bounds the request rate is read here: a
:class:`Snapshot` holds utime + stime of every thread of a process and of its
descendants (``/proc/<pid>/task/<tid>/stat``, named by
``/proc/<pid>/task/<tid>/comm``: the server names its threads, see
:mod:`lmc_server.threadnames`); :func:`cpu_report` turns two snapshots and the requests
served between them into CPU per request by thread group, each group's busy fraction,
the busiest thread and the request rate at which it would be 100% busy.

Invariants: the kernel reports CPU time in clock ticks (``SC_CLK_TCK``, 100 per second on
Linux), and its per-thread total is the scheduler's exact run time rounded to a tick, so
a window of ``w`` seconds resolves a busy fraction to ``1 / (100 w)``. A thread that
started inside the window counts from zero; one that ended inside it is missing from the
thread groups but not from its process's total (``processes``). Reading never raises for
a thread or process that exits while it is read; a server that is gone gives an empty
snapshot.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC = Path("/proc")
#: Seconds per clock tick of ``/proc/*/stat``'s utime and stime.
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

#: Thread groups by OS thread name, first match wins; a process's main thread (tid ==
#: pid, the server's event loop) is ``loop`` whatever its name, the rest ``other``.
GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("copy_waiters", re.compile(r"lmc-cuda\d+-wait")),
    ("copy_threads", re.compile(r"lmc-copy")),
    ("zmq_io", re.compile(r"ZMQbg/")),
    ("cuda", re.compile(r"cuda")),  # the CUDA driver's own (cuda-EvtHandlr, cuda0000...)
    ("pool", re.compile(r"lmc-pool-")),
    ("gpu_sampler", re.compile(r"lmc-gpu\d+-busy")),
    ("tiers", re.compile(r"lmc-(l2|disk|redis|mooncake)")),
    ("metrics", re.compile(r"lmc-metrics")),
)
GROUP_NAMES = ("loop", *(g for g, _ in GROUPS), "other")
#: Groups whose CPU is not Python holding the GIL: ZMQ's I/O threads and the CUDA
#: driver's own run no Python, and the cpu engine's copy threads spend their time in
#: numpy copies, which release it. Every other group's CPU counts as GIL time.
NO_GIL_GROUPS = frozenset({"zmq_io", "cuda", "copy_threads"})


@dataclass(frozen=True, slots=True)
class ThreadTime:
    pid: int
    tid: int
    name: str
    ticks: int  # utime + stime, clock ticks

    @property
    def group(self) -> str:
        return group_of(self.pid, self.tid, self.name)


@dataclass(frozen=True)
class Snapshot:
    """CPU seconds of every thread (by ``(pid, tid)``) and process at ``t_s``
    (``time.monotonic()``)."""

    t_s: float
    threads: dict[tuple[int, int], ThreadTime] = field(default_factory=dict)
    #: pid -> (name, CPU ticks of all its threads, ended ones included)
    processes: dict[int, tuple[str, int]] = field(default_factory=dict)


def group_of(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "loop"
    for group, pattern in GROUPS:
        if pattern.match(name):
            return group
    return "other"


def _stat(path: Path) -> tuple[str, int] | None:
    """(name, utime + stime in ticks) of one ``stat`` file, or None if it is gone."""
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    lo, hi = text.index("("), text.rindex(")")
    rest = text[hi + 2 :].split()
    return text[lo + 1 : hi], int(rest[11]) + int(rest[12])


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (through ``/proc/<pid>/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = list((PROC / str(p) / "task").iterdir())
        except (FileNotFoundError, ProcessLookupError):
            continue
        for task in tasks:
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return out


def snapshot(pid: int) -> Snapshot:
    """Every thread of ``pid`` and of its descendants, now."""
    snap = Snapshot(time.monotonic())
    for p in process_tree(pid):
        base = PROC / str(p)
        total = _stat(base / "stat")
        if total is None:
            continue
        snap.processes[p] = total
        try:
            tasks = list((base / "task").iterdir())
        except (FileNotFoundError, ProcessLookupError):
            continue
        for task in tasks:
            got = _stat(task / "stat")
            if got is not None:
                tid = int(task.name)
                snap.threads[(p, tid)] = ThreadTime(p, tid, got[0], got[1])
    return snap


def _seconds(ticks: int) -> float:
    """Ticks as seconds (0 for a negative difference: a tid the kernel reused)."""
    return round(max(0, ticks) * TICK_S, 6)


def _per_request(cpu_s: float, requests: int) -> float | None:
    return 1e6 * cpu_s / requests if requests else None


def cpu_report(a: Snapshot, b: Snapshot, requests: int) -> dict[str, Any]:
    """What the threads did between ``a`` and ``b`` while ``requests`` were served.

    ``groups[g]``: threads, ``cpu_s``, ``cpu_us_per_request``, ``busy`` (CPU s / wall
    s: above 1 for a group of several busy threads). ``busiest_thread``: the one thread
    with the most CPU, its busy fraction and CPU per request. ``saturation_requests_per_s``:
    requests/s divided by that thread's busy fraction, the rate at which it would be
    100% busy if its cost per request stayed the same (an extrapolation);
    ``loop_saturation_requests_per_s`` the same for the busiest event loop.

    The server's Python threads (its event loop, copy waiters, tiers: every group but
    :data:`NO_GIL_GROUPS`) take turns on one GIL, so the loop is not the only bound: a
    launch or completion a copy waiter runs is Python time the loop cannot use.
    ``gil_busy`` is, per process, the CPU of those threads over the wall time, the
    largest over the processes (an upper bound on the time the GIL is held: some of it
    is a C call that released it), and ``gil_saturation_requests_per_s`` the rate at
    which it would reach 1: a lower bound on the ceiling where the thread figure above
    is an upper one.
    """
    wall_s = b.t_s - a.t_s
    moved: list[tuple[ThreadTime, float]] = []
    for key, t in b.threads.items():
        before = a.threads.get(key)
        ticks = t.ticks - (before.ticks if before is not None else 0)
        moved.append((t, _seconds(ticks)))
    groups: dict[str, dict[str, Any]] = {}
    for t, cpu in moved:
        g = groups.setdefault(t.group, {"threads": 0, "cpu_s": 0.0})
        g["threads"] += 1
        g["cpu_s"] += cpu
    for g in groups.values():
        g["cpu_s"] = round(g["cpu_s"], 6)
        g["cpu_us_per_request"] = _per_request(g["cpu_s"], requests)
        g["busy"] = g["cpu_s"] / wall_s if wall_s > 0 else None
    ordered = {name: groups[name] for name in GROUP_NAMES if name in groups}
    rate = requests / wall_s if wall_s > 0 else None

    def described(t: ThreadTime, cpu: float) -> dict[str, Any]:
        return {
            "pid": t.pid,
            "tid": t.tid,
            "name": t.name,
            "group": t.group,
            "cpu_s": cpu,
            "busy": cpu / wall_s if wall_s > 0 else None,
            "cpu_us_per_request": _per_request(cpu, requests),
        }

    def saturation(busy: float | None) -> float | None:
        # one thread is at most 100% busy; a reading above 1 is tick rounding
        return rate / min(busy, 1.0) if rate is not None and busy else None

    busiest = described(*max(moved, key=lambda m: m[1])) if moved else None
    loops = [m for m in moved if m[0].group == "loop"]
    loop = described(*max(loops, key=lambda m: m[1])) if loops else None
    gil_cpu: dict[int, float] = {}
    for t, cpu in moved:
        if t.group not in NO_GIL_GROUPS:
            gil_cpu[t.pid] = gil_cpu.get(t.pid, 0.0) + cpu
    gil_busy = max(gil_cpu.values()) / wall_s if gil_cpu and wall_s > 0 else None
    processes = []
    for pid, (name, ticks) in b.processes.items():
        cpu = _seconds(ticks - a.processes.get(pid, (name, 0))[1])
        processes.append(
            {
                "pid": pid,
                "name": name,
                "cpu_s": cpu,
                "busy": cpu / wall_s if wall_s > 0 else None,
                "cpu_us_per_request": _per_request(cpu, requests),
            }
        )
    return {
        "wall_s": wall_s,
        "requests": requests,
        "requests_per_s": rate,
        "cpu_resolution_s": TICK_S,
        "groups": ordered,
        "busiest_thread": busiest,
        "saturation_requests_per_s": saturation(busiest["busy"] if busiest else None),
        "loop_thread": loop,
        "loop_saturation_requests_per_s": saturation(loop["busy"] if loop else None),
        "gil_busy": gil_busy,
        "gil_saturation_requests_per_s": saturation(gil_busy),
        "processes": processes,
    }
