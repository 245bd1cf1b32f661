"""Phase 3 of ``lmcache bench ranks``: one rank killed with SIGKILL mid-run.

Within ``KILL_DETECT_S`` the server's registrations must drop by one and, on cpu (where
the victim's KV is POSIX shared memory the server maps), its segments must be unmapped
from the server process. Apart from :mod:`.run` because both modes (the TP soak and the
DP phase) call it halfway through their timed phase.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from lmc_server.bench.ranks.config import KILL_DETECT_S
from lmc_server.bench.ranks.procs import RankProcess, maps_hold
from lmc_server.client.sync import Client
from lmc_server.testing.poll import wait_for


def kill_phase(
    victim: RankProcess, admin: Client, server_pid: int
) -> tuple[dict[str, Any], dict[str, bool]]:
    """Kill ``victim``, then poll until the server dropped its registration (and
    unmapped its segments); returns the phase's summary and checks."""
    before = admin.stats().registrations
    victim.kill()
    t0 = time.monotonic()
    names = victim.info.get("segments", [])
    detect_s = unmapped_s = None

    def settled() -> bool:
        nonlocal detect_s, unmapped_s
        now = time.monotonic() - t0
        if detect_s is None and admin.stats().registrations == before - 1:
            detect_s = now
        if names and unmapped_s is None and maps_hold(server_pid, names) is False:
            unmapped_s = now
        return detect_s is not None and (unmapped_s is not None or not names)

    with contextlib.suppress(TimeoutError):  # what was not seen in time is None
        wait_for(settled, "the dead rank reaped", KILL_DETECT_S, 0.05, TimeoutError)
    p3 = {
        "victim_rank": victim.rank,
        "registrations_before": before,
        "registrations_after": admin.stats().registrations,
        "detected_s": detect_s,
        "unmapped_s": unmapped_s,
        "limit_s": KILL_DETECT_S,
    }
    checks = {"p3 dead rank's registration dropped within 5 s": detect_s is not None}
    if names:
        checks["p3 dead rank's segments unmapped within 5 s"] = unmapped_s is not None
    return p3, checks
