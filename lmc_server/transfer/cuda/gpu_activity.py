"""Whether a GPU is computing: what copy mode ``auto`` of the CUDA engine decides by.

Measured on the H200 (docs/gpu.md, ``lmcache bench interference``): while another
process computes, every kernel the server launches waits for a time slice of the GPU
and costs that process 7-19 % of its throughput, whereas copy-engine DMAs run beside
it at almost no cost (0-2.4 %). On an idle GPU the reverse holds for speed: the short SM
gather into staging plus one DMA reaches 0.98 of the link, the copy engines' 2-D copies
0.85-0.89 (wide 1-D copies of block-outermost pages reach the link there too). So ``auto``
uses the copy engines while the GPU is busy, and staging while it is idle unless a
request's blocks are wide; this module says which it is.

The signal is NVML's per-process SM utilization (``nvmlDeviceGetProcessUtilization``:
per process, the share of the last sample period its kernels held the SMs), summed over
the other processes on the GPU, read through ``libnvidia-ml`` with ctypes (it ships with the
driver; no Python package needed) at most every ``refresh_s``. The device-wide
``utilization.gpu`` is not used: in a run on the H200 a gate on it never saw the idle GPU
again once the server's own copy-engine DMAs ran (``auto`` gave dma's figures on the idle
GPU), so it counts copy-engine activity. SM utilization does not count DMAs, and the server's own
staging kernels stay under the idle threshold. :class:`BusyGate` adds hysteresis so
that a load near the threshold does not flip the path on every request. Where NVML
cannot answer (no library, MIG instances, a permission error) the GPU counts as busy:
the copy engines are never the wrong choice for the engine beside the server, only a
slower one on an idle GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable

from lmc_server.threadnames import name_os_thread

log = logging.getLogger(__name__)

#: Kernel time (percent) at or above which an idle GPU counts as busy, and below which
#: a busy one counts as idle again. The server's own staging kernels stay well under
#: the lower bound (a 345 MB gather is ~0.25 ms of a 6.3 ms copy).
BUSY_PCT = 20
IDLE_PCT = 10
REFRESH_S = 0.1
#: NVML samples process utilization at a period of its own, so a read soon after the
#: last sample finds none newer
#: (``NVML_ERROR_NOT_FOUND``). That is "no news", not "idle": the reader keeps its
#: last figure until no sample has come for this long, and only then answers 0. (Taking
#: it as idle makes ``auto`` flip to staging on about every other request beside a GEMM
#: engine, which costs that engine 3-6 %, docs/gpu.md.)
STALE_S = 1.0


class _ProcessSample(ctypes.Structure):
    """``nvmlProcessUtilizationSample_t``."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


NVML_SUCCESS = 0
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
MAX_SAMPLES = 256


class NvmlUtilization:
    """SM-time percent of one GPU, summed over its processes, found by PCI bus id (CUDA
    device numbers and NVML indices differ under ``CUDA_VISIBLE_DEVICES``). ``read``
    returns ``None`` when NVML cannot answer.

    The reading process's own samples are left out: its staging kernels take a
    share of the SMs on an idle GPU (more with loads in flight), and counting them
    flipped ``auto`` to the copy engines and back. Where the process runs in its own
    PID namespace (a container without ``--pid=host``) NVML's host PIDs do not match
    ``own_pid`` and its kernels count; the gate's hysteresis then has to absorb them.

    ``lib`` stands in for ``libnvidia-ml`` (tests); ``clock`` measures ``STALE_S``.
    """

    _lib: ctypes.CDLL | None = None
    _lock = threading.Lock()

    def __init__(
        self,
        pci_bus_id: str,
        *,
        lib: ctypes.CDLL | None = None,
        clock: Callable[[], float] = time.monotonic,
        own_pid: int | None = None,
    ) -> None:
        self.pci_bus_id = pci_bus_id
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self._handle: ctypes.c_void_p | None = None
        self._seen_us = 0
        self._samples = (_ProcessSample * MAX_SAMPLES)()
        self._clock = clock
        self._last_pct = 0
        self._sampled_at = -float("inf")
        self._nvml: ctypes.CDLL | None = None
        if lib is None:
            lib = self._library()
        if lib is None:
            return
        self._nvml = lib
        handle = ctypes.c_void_p()
        rc = lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle))
        if rc != NVML_SUCCESS:
            log.warning(
                "NVML has no device at PCI bus id %s (error %d): the GPU counts as busy",
                pci_bus_id,
                rc,
            )
            return
        self._handle = handle

    @classmethod
    def _library(cls) -> ctypes.CDLL | None:
        with cls._lock:
            if cls._lib is None:
                try:
                    lib = ctypes.CDLL("libnvidia-ml.so.1")
                    rc = lib.nvmlInit_v2()
                except (OSError, AttributeError) as e:
                    log.warning("NVML is not available (%s): the GPU counts as busy", e)
                    return None
                if rc != NVML_SUCCESS:
                    log.warning("nvmlInit failed (error %d): the GPU counts as busy", rc)
                    return None
                cls._lib = lib
            return cls._lib

    def read(self) -> int | None:
        """Sum over processes of their SM percent in the samples since the last read;
        with no newer sample, the last sum, or 0 once none came for ``STALE_S``."""
        if self._handle is None or self._nvml is None:
            return None
        count = ctypes.c_uint(MAX_SAMPLES)
        rc = self._nvml.nvmlDeviceGetProcessUtilization(
            self._handle, self._samples, ctypes.byref(count), ctypes.c_ulonglong(self._seen_us)
        )
        now = self._clock()
        if rc == NVML_ERROR_NOT_FOUND or (rc == NVML_SUCCESS and count.value == 0):
            if now - self._sampled_at >= STALE_S:
                self._last_pct = 0
            return self._last_pct
        if rc not in (NVML_SUCCESS, NVML_ERROR_INSUFFICIENT_SIZE):
            return None
        per_pid: dict[int, int] = {}
        for k in range(min(count.value, MAX_SAMPLES)):
            smp = self._samples[k]
            self._seen_us = max(self._seen_us, int(smp.timeStamp))
            if int(smp.pid) == self.own_pid:
                continue  # the server's own staging kernels are not an engine computing
            per_pid[int(smp.pid)] = max(per_pid.get(int(smp.pid), 0), int(smp.smUtil))
        self._sampled_at = now
        self._last_pct = min(100, sum(per_pid.values()))
        return self._last_pct


class BusyGate:
    """``busy()``: whether the GPU computes, from ``read_pct`` with hysteresis.

    ``read_pct`` is called at most every ``refresh_s`` (by whichever thread asks first
    after that); ``None`` from it means unknown, which counts as busy.
    """

    def __init__(
        self,
        read_pct: Callable[[], int | None],
        *,
        busy_pct: int = BUSY_PCT,
        idle_pct: int = IDLE_PCT,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
        name: str = "gpu",
    ) -> None:
        assert 0 <= idle_pct <= busy_pct <= 100, "idle_pct <= busy_pct"
        self._read = read_pct
        self.busy_pct = busy_pct
        self.idle_pct = idle_pct
        self.refresh_s = refresh_s
        self._clock = clock
        self.name = name
        self._busy = True
        self._checked_at = -float("inf")
        self.last_pct: int | None = None

    def busy(self) -> bool:
        """The current decision, reading ``read_pct`` first if ``refresh_s`` passed."""
        now = self._clock()
        if now - self._checked_at >= self.refresh_s:
            self.update(now)
        return self._busy

    def force_busy(self) -> None:
        """Count the GPU as busy until the next read (a reader that raised)."""
        self._busy = True
        self.last_pct = None

    @property
    def state(self) -> bool:
        """The last decision, without reading."""
        return self._busy

    def update(self, now: float | None = None) -> bool:
        """Read ``read_pct`` now and decide, with hysteresis."""
        self._checked_at = self._clock() if now is None else now
        pct = self._read()
        self.last_pct = pct
        was = self._busy
        if pct is None:
            self._busy = True
        elif self._busy:
            self._busy = pct >= self.idle_pct
        else:
            self._busy = pct >= self.busy_pct
        if self._busy != was:
            log.info(
                "%s %s (kernels %s%% of the time): copies use %s",
                self.name,
                "busy" if self._busy else "idle",
                "?" if pct is None else pct,
                "the copy engines" if self._busy else "SM staging",
            )
        return self._busy


class SampledGate:
    """A :class:`BusyGate` read on a thread of its own every ``refresh_s``, so that no
    copy waits for NVML.

    ``nvmlDeviceGetProcessUtilization`` is slow: in a py-spy profile of a server on the
    H200 reading it on the event loop every 0.1 s (one request at a time), the reads
    took 1.3-1.8 ms each, a fifth of the event loop's time, and every request behind a
    read waited for it. Here a copy only reads
    the last decision (a bool, set by the sampler alone); until the first sample the
    gate says busy, which picks the copy engines, never a wrong byte. ctypes releases the
    GIL during the NVML call, so the sampler does not hold up the event loop either.
    """

    def __init__(self, gate: BusyGate) -> None:
        self.gate = gate
        self._stop = threading.Event()
        tag = gate.name.lower().replace(" ", "")  # "GPU 0" -> lmc-gpu0-busy
        self._thread = threading.Thread(target=self._run, name=f"lmc-{tag}-busy", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self.gate.state

    @property
    def last_pct(self) -> int | None:
        return self.gate.last_pct

    def _run(self) -> None:
        name_os_thread()
        while True:
            try:
                self.gate.update()
            except Exception:  # a failing reader must not end sampling: unknown is busy
                log.exception(
                    "%s: reading GPU activity failed; counting it as busy", self.gate.name
                )
                self.gate.force_busy()
            if self._stop.wait(self.gate.refresh_s):
                return

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
