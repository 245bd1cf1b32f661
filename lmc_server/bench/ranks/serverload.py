"""The server's CPU by thread during a timed phase of ``lmcache bench ranks``.

Every timed phase (each TP phase, phase 2, the DP phase) runs a :class:`ServerLoad`:
a thread of the parent that, inside the phase, snapshots the server's threads
(:mod:`lmc_server.bench.threadcpu`) and its request counters (``stats``) at the start
of a window and again at its end. The window leaves a margin at both ends
(:func:`window`), so it covers the ranks' steady state, not their start or the byte
check after the loop; the parent's own work during the phase (phase 3's kill and its
polls) does not move it. Requests are the ones the server answered in the window, by
its own counters, less its ``stats`` requests (this probe's and the parent's: they
watch the run, they are not its load).

The result is :func:`~lmc_server.bench.threadcpu.cpu_report`'s, plus ``requests_by_op``
and ``retrieve_plans`` (the window's retrieves by how the index planned them);
``{"error": ...}`` if the server could not be read (the run goes on without it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from lmc_server.bench.threadcpu import Snapshot, cpu_report, snapshot
from lmc_server.client.core import ServerError
from lmc_server.client.sync import Client

log = logging.getLogger(__name__)

#: The window starts this far into a phase and ends this far before its end
#: (at most; a tenth of the phase when that is less).
MARGIN_S = 0.25
#: Ops that watch the run rather than load it (not counted as requests).
NOT_LOAD = frozenset({"stats"})


def window(t0_s: float, duration_s: float) -> tuple[float, float]:
    """The sampling window (monotonic seconds) of a phase that starts at ``t0_s``."""
    margin = min(MARGIN_S, duration_s / 10)
    return t0_s + margin, t0_s + duration_s - margin


def _answered(client: Client) -> tuple[dict[str, int], dict[str, int]]:
    """Requests answered so far by op (outcomes summed), and retrieves by how the index
    planned them (``retrieve_plans``: identical retrieves of TP ranks share a plan)."""
    counters = client.stats().counters
    out: dict[str, int] = {}
    for key, n in counters.requests.items():
        op = key.partition(":")[0]
        out[op] = out.get(op, 0) + n
    return out, dict(counters.retrieve_plans)


class ServerLoad:
    """Samples the server process ``pid`` (and its children) between ``start_s`` and
    ``end_s`` on a thread of its own; :meth:`result` waits for it."""

    def __init__(self, pid: int, endpoint: str, start_s: float, end_s: float) -> None:
        self.pid, self.endpoint = pid, endpoint
        self.start_s, self.end_s = start_s, end_s
        self._result: dict[str, Any] = {"error": "not sampled"}
        self._thread = threading.Thread(target=self._run, name="lmc-bench-load", daemon=True)
        self._thread.start()

    @classmethod
    def for_phase(cls, pid: int, endpoint: str, duration_s: float) -> ServerLoad:
        """A probe of a phase that starts now and lasts ``duration_s``."""
        return cls(pid, endpoint, *window(time.monotonic(), duration_s))

    def _run(self) -> None:
        try:
            with Client(self.endpoint, timeout_s=30, client_name="bench-load") as c:
                time.sleep(max(0.0, self.start_s - time.monotonic()))
                a: Snapshot = snapshot(self.pid)
                ra, pa = _answered(c)
                time.sleep(max(0.0, self.end_s - time.monotonic()))
                rb, pb = _answered(c)
                b = snapshot(self.pid)
        except (OSError, ValueError, TimeoutError, ConnectionError, ServerError) as e:
            log.warning("reading the server's load failed: %s", e)
            self._result = {"error": f"{type(e).__name__}: {e}"}
            return
        by_op = {op: n - ra.get(op, 0) for op, n in rb.items() if n - ra.get(op, 0)}
        requests = sum(n for op, n in by_op.items() if op not in NOT_LOAD)
        plans = {k: n - pa.get(k, 0) for k, n in pb.items()}
        self._result = {
            **cpu_report(a, b, requests),
            "requests_by_op": by_op,
            "retrieve_plans": plans,
        }

    def result(self, timeout_s: float = 60.0) -> dict[str, Any]:
        self._thread.join(max(0.0, self.end_s - time.monotonic()) + timeout_s)
        if self._thread.is_alive():
            return {"error": "the server's load was not read in time"}
        return self._result
