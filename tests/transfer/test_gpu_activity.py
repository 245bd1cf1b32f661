"""BusyGate: the busy/idle decision copy mode ``auto`` makes, on a fake clock and reader."""

from __future__ import annotations

import time

import pytest

from lmc_server.transfer.cuda.gpu_activity import BusyGate, NvmlUtilization, SampledGate


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


class FakeNvml:
    """Stands in for ``libnvidia-ml``: the two calls the reader makes, answering the
    per-process samples a test queues (``None``: no sample newer than asked for)."""

    def __init__(self) -> None:
        self.answers: list[list[tuple[int, int, int]] | None] = []
        self.asked_since: list[int] = []

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus_id: bytes, handle: object) -> int:
        handle._obj.value = 1  # type: ignore[attr-defined]
        return 0

    def nvmlDeviceGetProcessUtilization(
        self, handle: object, samples: object, count: object, since: object
    ) -> int:
        self.asked_since.append(since.value)  # type: ignore[attr-defined]
        answer = self.answers.pop(0)
        if answer is None:
            return 6  # NVML_ERROR_NOT_FOUND
        for k, (pid, stamp_us, sm_pct) in enumerate(answer):
            samples[k].pid, samples[k].timeStamp, samples[k].smUtil = (  # type: ignore[index]
                pid,
                stamp_us,
                sm_pct,
            )
        count._obj.value = len(answer)  # type: ignore[attr-defined]
        return 0


def test_no_new_sample_is_no_news_until_stale() -> None:
    """NVML samples at its own period, so a read 0.1 s after one may find nothing newer: the
    last figure stands (the engine is still computing) until no sample came for
    STALE_S, then the GPU reads idle."""
    from lmc_server.transfer.cuda.gpu_activity import STALE_S

    clock, lib = Clock(), FakeNvml()
    reader = NvmlUtilization(
        "0000:00:00.0",
        lib=lib,  # type: ignore[arg-type]
        clock=clock,
        own_pid=99,
    )
    lib.answers = [
        [(10, 1_000, 95), (11, 1_100, 3), (10, 1_200, 97), (99, 1_150, 40)],
        None,
        None,
        None,
        [(10, 9_000, 0)],
    ]
    assert reader.read() == 100  # the engine's 97 plus another process's 3
    clock.t += 0.1
    assert reader.read() == 100  # no sample newer: still busy
    clock.t += STALE_S - 0.2
    assert reader.read() == 100
    clock.t += 0.2
    assert reader.read() == 0  # nothing for STALE_S: idle
    assert reader.read() == 0  # a sample of an idle process
    # each read asks only for samples newer than the newest it has seen
    assert lib.asked_since == [0, 1_200, 1_200, 1_200, 1_200]


def test_own_kernels_do_not_make_the_gpu_busy() -> None:
    """The server's own staging kernels (its pid) are left out of the sum."""
    lib = FakeNvml()
    reader = NvmlUtilization(
        "0000:00:00.0",
        lib=lib,  # type: ignore[arg-type]
        clock=Clock(),
        own_pid=99,
    )
    lib.answers = [[(99, 1_000, 35), (10, 1_000, 4)]]
    assert reader.read() == 4


def test_gate_stays_on_copy_engines_between_nvml_samples() -> None:
    """The gate beside a computing engine: reads every 0.1 s, NVML samples less often;
    busy throughout (it flipped to idle on every read between samples before)."""
    clock, lib = Clock(), FakeNvml()
    reader = NvmlUtilization("0000:00:00.0", lib=lib, clock=clock)  # type: ignore[arg-type]
    g = BusyGate(reader.read, refresh_s=0.1, clock=clock)
    seen = []
    for k in range(20):
        t_us = int(clock.t * 1e6)
        fresh = k % 5 in (0, 2)  # a new sample on two reads of five, none in between
        lib.answers.append([(10, t_us + 1, 99)] if fresh else None)
        seen.append(g.busy())
        clock.t += 0.1
    assert all(seen)


def test_sampled_gate_reads_on_its_own_thread_and_stops() -> None:
    """The sampler reads the reader off the caller's thread; callers only see the last
    decision (busy until the first read), and close stops the reads."""
    import threading

    readings = iter([0] * 3 + [90] * 1000)
    readers: set[str] = set()
    read_count = 0
    fourth = threading.Event()

    def read() -> int:
        nonlocal read_count
        readers.add(threading.current_thread().name)
        read_count += 1
        if read_count >= 4:
            fourth.set()
        return next(readings)

    inner = BusyGate(read, busy_pct=20, idle_pct=10, refresh_s=0.01, name="fake")
    sampled = SampledGate(inner)
    try:
        assert fourth.wait(10), "the sampler never read four times"
        # three idle readings, then busy ones: the gate follows without a caller reading
        for _ in range(1000):
            if sampled.busy() and sampled.last_pct == 90:
                break
            time.sleep(0.01)
        assert sampled.busy() and sampled.last_pct == 90
        assert readers == {"lmc-fake-busy"}
    finally:
        sampled.close()
    after = read_count
    time.sleep(0.05)
    assert read_count == after  # closed: no more reads


def test_sampled_gate_counts_a_failing_reader_as_busy() -> None:
    import threading

    calls = 0
    raised = threading.Event()

    def read() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            return 0
        raised.set()
        raise OSError("NVML went away")

    inner = BusyGate(read, busy_pct=20, idle_pct=10, refresh_s=0.01, name="failing")
    inner.update()  # idle
    assert not inner.state
    sampled = SampledGate(inner)
    try:
        assert raised.wait(10)
        for _ in range(1000):
            if sampled.busy():
                break
            time.sleep(0.01)
        assert sampled.busy() and sampled.last_pct is None
    finally:
        sampled.close()
