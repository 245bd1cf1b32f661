"""How a lane's waiter thread waits for its copy to finish on the GPU.

``block`` sleeps in ``cudaEventSynchronize`` on a blocking-sync event; ``hybrid``
(default) sleeps (``time.sleep``) until shortly before the copy's expected end at
``EXPECTED_BPS`` and then polls the event, yielding the GIL between polls, for at most
``SPIN_S`` before falling back to the blocking wait. Measured on the H200 (docs/gpu.md):
the blocking wait's wake-up added ~0.15 ms to every copy, the hybrid wait ~0.02 ms; the
price is at most ``SPIN_S`` of one core per copy.

``hybrid`` polls only while the copy is the only one of its GPU (:func:`wait_mode`): a
lone request is the one whose time the wake-up adds to. With other lanes busy the link
stays busy through a late wake-up, and each poll takes the GIL from the event loop that
is issuing those other copies: 8 TP ranks loading 4-chunk prefixes on one H200 reached
0.68-0.81 of the link with every waiter polling and 0.82-0.85 with every waiter
blocking (the loop's time per load 186-233 us against 149-188), in one run.

A copy's expected end counts the copies launched before it in the same direction on the
same GPU (:class:`LinkClock`): they share the GPU's copy engines, so with several lanes
busy a copy ends after theirs, and a waiter that expected it at its own size alone would
spin for nothing, taking the GIL from the event loop at every poll.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no CuPy at import: LinkClock is tested on CPU-only hosts
    from lmc_server.transfer.cuda.lanes import Lane

WAIT_MODES = ("block", "hybrid")
EXPECTED_BPS = 55e9
SPIN_S = 300e-6
WAKE_MARGIN_S = 150e-6


class LinkClock:
    """When the copies launched so far in one direction of one GPU's link are expected
    to be done, at ``EXPECTED_BPS``: a new copy of ``nbytes`` launched at ``now`` starts
    when they are and is expected ``nbytes / EXPECTED_BPS`` later. Callers serialize
    access (the engine's launch lock)."""

    __slots__ = ("_busy_until",)

    def __init__(self) -> None:
        self._busy_until: dict[tuple[int, bool], float] = {}

    def expect(self, device: int, to_pool: bool, nbytes: int, now: float) -> float:
        key = (device, to_pool)
        end = max(now, self._busy_until.get(key, 0.0)) + nbytes / EXPECTED_BPS
        self._busy_until[key] = end
        return end


def wait_mode(configured: str, busy_lanes: int) -> str:
    """The wait for a copy whose GPU has ``busy_lanes`` lanes taken (its own included):
    ``hybrid`` polls only for a lone copy, and blocks beside others (module docstring)."""
    return "block" if configured == "hybrid" and busy_lanes > 1 else configured


def wait_for_lane(lane: Lane, expected_end: float, mode: str) -> None:
    """Block until ``lane.done`` has completed (``expected_end``: the ``perf_counter``
    time the copy is expected to be done, :class:`LinkClock`)."""
    if mode == "hybrid":
        sleep_s = expected_end - WAKE_MARGIN_S - time.perf_counter()
        if sleep_s > 0:
            time.sleep(sleep_s)
        deadline = time.perf_counter() + SPIN_S
        while time.perf_counter() < deadline:
            if lane.done.done:
                return
            time.sleep(0)
    lane.done.synchronize()
