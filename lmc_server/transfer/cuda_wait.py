"""How a lane's waiter thread waits for its copy to finish on the GPU.

``block`` sleeps in ``cudaEventSynchronize`` on a blocking-sync event; ``hybrid``
(default) sleeps (``time.sleep``) until shortly before the copy's expected end at
``EXPECTED_BPS`` and then polls the event, yielding the GIL between polls, for at most
``SPIN_S`` before falling back to the blocking wait. Measured on the H200 (docs/gpu.md):
the blocking wait's wake-up added ~0.15 ms to every copy, the hybrid wait ~0.02 ms; the
price is at most ``SPIN_S`` of one core per copy.
"""

from __future__ import annotations

import time

from lmc_server.transfer.cuda_lanes import Lane

WAIT_MODES = ("block", "hybrid")
EXPECTED_BPS = 55e9
SPIN_S = 300e-6
WAKE_MARGIN_S = 150e-6


def wait_for_lane(lane: Lane, nbytes: int, t_start: float, mode: str) -> None:
    """Block until ``lane.done`` has completed (``t_start``: ``perf_counter`` time the
    copy of ``nbytes`` was planned, which dates its expected end)."""
    if mode == "hybrid":
        sleep_s = t_start + nbytes / EXPECTED_BPS - WAKE_MARGIN_S - time.perf_counter()
        if sleep_s > 0:
            time.sleep(sleep_s)
        deadline = time.perf_counter() + SPIN_S
        while time.perf_counter() < deadline:
            if lane.done.done:
                return
            time.sleep(0)
    lane.done.synchronize()
