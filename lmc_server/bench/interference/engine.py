"""The "engine" process of ``lmcache bench interference``: a GPU kept busy the way vLLM's is.

Run as ``python -m lmc_server.bench.interference.engine`` by the benchmark (JSON lines on
stdin and stdout, no pickle). It keeps its GPU busy with one of three workloads and
reports how much work it got done in a window of wall time:

``gemm``
    bf16 matmuls of 8192 x 8192 x 8192 back to back (compute-bound, like prefill); TFLOP/s.
``hbm``
    1 GiB device-to-device copies back to back (memory-bound, like attention over a
    long KV cache); GB/s of HBM traffic (bytes read plus bytes written).
``decode``
    a CUDA graph of many small kernels (per "layer": a 64 x 4096 x 4096 matmul and an
    activation, 61 layers), replayed back to back, like a decode step; steps/s.

Two iterations are kept queued (each a few ms of GPU work, bracketed by host waits on an
event), so the GPU never idles while the host counts; the host records the wall time at
which each iteration completed, and a window's throughput is the work of the iterations
completed in it over its length.

``own_copy`` starts the baseline every server figure is held against: this process's
own side-stream copy of the same bytes as one server request, contiguous, between its
device memory and its pinned host memory (``cudaMemcpyAsync``, what an engine that
offloads by itself would run), back to back until ``stop_copy``.

Commands: ``{"cmd": "kind", "kind": K}`` (build and warm up), ``measure`` (``seconds``),
``pause`` (idle GPU, until the next ``kind``), ``own_copy`` (``direction`` d2h|h2d, ``bytes``),
``stop_copy``, ``exit``. Each is answered with one JSON line.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from typing import Any

import torch

from lmc_server.bench.jsonproc import reply, serve_lines

GEMM_N = 8192
HBM_BYTES = 1 << 30
DECODE_LAYERS = 61
DECODE_BATCH = 64
DECODE_HIDDEN = 4096
UNITS = {"gemm": "TFLOP/s", "hbm": "GB/s", "decode": "steps/s"}


class Workload:
    """One iteration of GPU work and how much work it is, in the kind's unit."""

    def __init__(self, kind: str, device: torch.device) -> None:
        self.kind = kind
        self.graph: torch.cuda.CUDAGraph | None = None
        if kind == "gemm":
            self.a = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
            self.b = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
            self.c = torch.empty(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
            self.reps = 2
            self.work = self.reps * 2 * GEMM_N**3 / 1e12
        elif kind == "hbm":
            self.src = torch.empty(HBM_BYTES, device=device, dtype=torch.uint8)
            self.dst = torch.empty(HBM_BYTES, device=device, dtype=torch.uint8)
            self.reps = 4
            self.work = self.reps * 2 * HBM_BYTES / 1e9
        elif kind == "decode":
            self.x = torch.randn(DECODE_BATCH, DECODE_HIDDEN, device=device, dtype=torch.bfloat16)
            self.w = (
                torch.randn(DECODE_HIDDEN, DECODE_HIDDEN, device=device, dtype=torch.bfloat16)
                / DECODE_HIDDEN**0.5
            )
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up before capture, as torch requires
                self._decode_step()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._decode_step()
            self.reps = 4
            self.work = float(self.reps)
        else:
            raise ValueError(f"engine kind {kind!r}: expected one of {sorted(UNITS)}")

    def _decode_step(self) -> None:
        x = self.x
        for _ in range(DECODE_LAYERS):
            x = torch.nn.functional.silu(x @ self.w)
        self.x.copy_(x)

    def launch(self) -> None:
        for _ in range(self.reps):
            if self.kind == "gemm":
                torch.matmul(self.a, self.b, out=self.c)
            elif self.kind == "hbm":
                self.dst.copy_(self.src)
            else:
                assert self.graph is not None
                self.graph.replay()


class Engine:
    """The busy loop on a thread of its own; the main thread answers commands."""

    def __init__(self, device: int) -> None:
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.work: Workload | None = None
        self.done: deque[tuple[float, float]] = deque(maxlen=1 << 16)
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.stop = False
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.copier: threading.Thread | None = None
        self.copy_stop = threading.Event()
        self.copy_result: dict[str, float] = {}

    def set_kind(self, kind: str) -> dict[str, Any]:
        self.running.clear()
        time.sleep(0.05)
        with torch.cuda.stream(self.stream):
            self.work = Workload(kind, self.device)
        torch.cuda.synchronize(self.device)
        if not self.thread.is_alive():
            self.thread.start()
        self.running.set()
        time.sleep(0.5)  # clocks up, caches warm
        return {"kind": kind, "unit": UNITS[kind]}

    def _loop(self) -> None:
        events: deque[torch.cuda.Event] = deque()
        while not self.stop:
            if not self.running.is_set():
                while events:
                    events.popleft().synchronize()
                self.running.wait(0.1)
                continue
            work = self.work
            assert work is not None
            with torch.cuda.stream(self.stream):
                work.launch()
            ev = torch.cuda.Event()
            ev.record(self.stream)
            events.append(ev)
            if len(events) >= 2:
                events.popleft().synchronize()
                with self.lock:
                    self.done.append((time.perf_counter(), work.work))

    def pause(self) -> dict[str, Any]:
        self.running.clear()
        time.sleep(0.05)
        torch.cuda.synchronize(self.device)
        return {"paused": True}

    def measure(self, seconds: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        time.sleep(seconds)
        t1 = time.perf_counter()
        with self.lock:
            got = [(t, w) for t, w in self.done if t0 < t <= t1]
        if len(got) < 2:
            return {"throughput": float("nan"), "iterations": len(got)}
        # work completed after the first completion, over the time since it
        span = got[-1][0] - got[0][0]
        work = sum(w for _, w in got[1:])
        return {"throughput": work / span, "iterations": len(got), "seconds": span}

    def own_copy(self, direction: str, nbytes: int) -> dict[str, Any]:
        self.copy_stop.clear()
        self.copy_result = {}
        ready = threading.Event()
        self.copier = threading.Thread(
            target=self._copy_loop, args=(direction, nbytes, ready), name="own-copy", daemon=True
        )
        self.copier.start()
        ready.wait(30)
        return {"started": direction, "bytes": nbytes}

    def _copy_loop(self, direction: str, nbytes: int, ready: threading.Event) -> None:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        side = torch.cuda.Stream(self.device)
        copies, t0 = 0, 0.0
        ready.set()
        with torch.cuda.stream(side):
            while not self.copy_stop.is_set():
                if direction == "d2h":
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
                side.synchronize()
                if copies == 0:
                    t0 = time.perf_counter()
                copies += 1
        t1 = time.perf_counter()
        gbps = (copies - 1) * nbytes / (t1 - t0) / 1e9 if copies > 1 else float("nan")
        self.copy_result = {"own_gbps": gbps, "copies": copies}

    def stop_copy(self) -> dict[str, Any]:
        self.copy_stop.set()
        if self.copier is not None:
            self.copier.join(60)
        return dict(self.copy_result)


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    engine = Engine(int(cfg.get("device", 0)))
    reply({"ready": True, "gpu": torch.cuda.get_device_name(engine.device)})
    serve_lines(
        {
            "kind": lambda c: engine.set_kind(c["kind"]),
            "measure": lambda c: engine.measure(float(c["seconds"])),
            "pause": lambda c: engine.pause(),
            "own_copy": lambda c: engine.own_copy(c["direction"], int(c["bytes"])),
            "stop_copy": lambda c: engine.stop_copy(),
        }
    )
    engine.stop = True
    engine.running.set()


if __name__ == "__main__":
    main()
