"""The in-process server helper (lmc_server.testing.inprocess) keeps its promises."""

from __future__ import annotations

import pytest

from lmc_server.client import Client
from lmc_server.testing.inprocess import FakeClock, run_server


def test_fake_clock_moves_only_forward_and_only_when_told() -> None:
    clock = FakeClock(start_s=5.0)
    assert clock() == clock() == 5.0
    clock.advance(1.5)
    assert clock() == 6.5
    with pytest.raises(AssertionError, match="does not go back"):
        clock.advance(-1)


def test_server_reads_the_fake_clock() -> None:
    clock = FakeClock()
    with run_server(clock=clock, backend="null") as ts, Client(ts.endpoint) as c:
        up = c.stats().uptime_s
        clock.advance(3600)
        assert c.stats().uptime_s == up + 3600


def test_wait_housekeeping_fails_loudly_when_no_tick_comes() -> None:
    with run_server(backend="null", housekeeping_interval_s=3600) as ts:
        with pytest.raises(TimeoutError, match="housekeeping ticks did not run"):
            ts.wait_housekeeping(timeout_s=0.2)
