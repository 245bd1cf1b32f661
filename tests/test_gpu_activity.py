"""BusyGate: the busy/idle decision copy mode ``auto`` makes, on a fake clock and reader."""

from __future__ import annotations

import pytest

from lmc_server.transfer.gpu_activity import BusyGate, NvmlUtilization


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def gate(readings: list[int | None], clock: Clock) -> tuple[BusyGate, list[int]]:
    calls: list[int] = []

    def read() -> int | None:
        calls.append(1)
        return readings.pop(0)

    return BusyGate(read, busy_pct=20, idle_pct=10, refresh_s=0.1, clock=clock), calls


def test_hysteresis_between_the_two_thresholds() -> None:
    clock = Clock()
    g, _ = gate([0, 15, 25, 15, 9, 19], clock)
    seen = []
    for _ in range(6):
        seen.append(g.busy())
        clock.t += 0.125
    # idle at 0; 15 stays idle (below 20); 25 busy; 15 stays busy (>= 10); 9 idle; 19 idle
    assert seen == [False, False, True, True, False, False]


def test_reads_at_most_once_per_refresh_interval() -> None:
    clock = Clock()
    g, calls = gate([0, 90], clock)
    assert not g.busy()
    clock.t += 0.0625
    assert not g.busy() and len(calls) == 1  # cached: no second read yet
    clock.t += 0.0625
    assert g.busy() and len(calls) == 2
    assert g.last_pct == 90


def test_unknown_counts_as_busy() -> None:
    clock = Clock()
    g, _ = gate([None, 0, None], clock)
    assert g.busy()  # before any answer, and NVML silent: the copy engines
    clock.t += 1
    assert not g.busy()
    clock.t += 1
    assert g.busy()


def test_thresholds_must_be_ordered() -> None:
    with pytest.raises(AssertionError):
        BusyGate(lambda: 0, busy_pct=10, idle_pct=20)


def test_nvml_without_a_device_reads_none() -> None:
    """On a machine without the NVIDIA driver (CI) or for a bus id NVML does not know,
    the reader answers None, which the gate takes as busy."""
    reader = NvmlUtilization("ffff:ff:1f.7")
    assert reader.read() is None
    assert BusyGate(reader.read).busy()
