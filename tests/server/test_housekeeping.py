"""A daemon that runs for months holds flat memory: housekeeping keeps no growing state.

The housekeeping tick expires leases, forgets idle sessions and logs evictions. It used
to keep every timer handle it ever scheduled in a list (about 4 a second while idle).
Here a server runs thousands of ticks with a fake clock that jumps ahead on every
reading, so every job runs on every tick, and the memory Python holds must not grow.
"""

from __future__ import annotations

import tracemalloc

from lmc_server.client import Client
from lmc_server.config import Config
from lmc_server.testing.inprocess import ThreadServer
from lmc_server.testing.process import free_port


class JumpingClock:
    """Each reading is an hour after the previous one."""

    def __init__(self) -> None:
        self.now = 1e6

    def __call__(self) -> float:
        self.now += 3600.0
        return self.now


def test_idle_housekeeping_holds_flat_memory() -> None:
    ts = ThreadServer(
        Config(port=free_port(), backend="null", l1_size_gb=1, metrics_port=0),
        clock=JumpingClock(),
        housekeeping_interval_s=0.0002,
    ).start()
    try:
        with Client(ts.endpoint) as c:  # a session to sweep, then idle
            c.ping()
        server = ts.server
        ts.wait_housekeeping(ticks=300, timeout_s=10)
        tracemalloc.start(1)
        try:
            base = tracemalloc.take_snapshot()
            t0 = server.housekeeping_ticks
            ts.wait_housekeeping(ticks=2000, timeout_s=30)
            ticks = server.housekeeping_ticks - t0
            grown = sum(
                d.size_diff
                for d in tracemalloc.take_snapshot().compare_to(base, "filename")
                if d.size_diff > 0
            )
        finally:
            tracemalloc.stop()
        assert ticks >= 2000, f"only {ticks} housekeeping ticks ran"
        # a leak of ~3 timer handles (~600 bytes) per tick would hold ~1.2 MB by now
        assert grown < 64 * 1024, f"{grown} bytes more held after {ticks} idle ticks"
        with Client(ts.endpoint) as c:
            assert c.ping().ready
    finally:
        ts.stop()
    assert ts.exit_code == 0
