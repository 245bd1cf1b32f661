"""Where a copy-mode ``dma`` request's time goes, per KV layout, beside a busy engine.

Run on the GPU machine from the source tree (``PYTHONPATH=$PWD python3
scripts/gpu-dma-layouts.py --json out.json``). For each layout (the DSV4.1 preset
layer- or block-outermost, consecutive or random block ids; the Llama-3-8B-like preset
in the FlashAttention and FlashInfer shapes) it plans a 64-chunk request with the
engine's own planner (``plan_dma`` over real device buffers and a pinned pool) and
issues it with the engine's own ``issue_dma`` on real lanes, in several ways:

``cur``
    one DMA stream, 1-D rows in one ``cuMemcpyBatchAsync`` call, 2-D rows one
    ``cudaMemcpy2DAsync`` each (the engine before the 2-D batches);
``bN``
    ``N`` DMA streams per lane, 1-D and 2-D rows in one batch call per stream;
``raw``
    one contiguous ``cudaMemcpyAsync`` of the request's bytes (the link);
``d2d``
    the ``b4`` copies with the pool in device memory instead (what a copy-engine
    gather into a device staging buffer would cost before its one contiguous DMA).

each with one or two requests in flight (one lane each, every lane kept busy), both
directions, on the idle GPU and beside the interference benchmark's engines (another
process, ``lmc_server.bench.interference.engine``), whose throughput is measured in the
same window. Reported per point: GB/s, the host's issue time per request, descriptors
per request (1-D / 2-D, bytes per row), the engine's loss. Prints a table last.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import threading
import time
from typing import Any

import cupy
import numpy as np

from lmc_server.bench.common import GeometryArgs
from lmc_server.bench.jsonproc import JsonLineProcess
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.layout import RunCopy, build_layout, plan_copies, section_block_ids
from lmc_server.transfer.cuda.batch import BatchCopier, batch_copier
from lmc_server.transfer.cuda.dma_plan import HEIGHT, WIDTH, DmaPlan, plan_dma
from lmc_server.transfer.cuda.lanes import Lane
from lmc_server.transfer.cuda.launch import issue_dma
from lmc_server.transfer.cuda.units import Region

CHUNKS = 64
LAYOUTS = {
    "dsv-layer-consecutive": ("dsv41", "layer", "consecutive"),
    "dsv-layer-random": ("dsv41", "layer", "random"),
    "dsv-block-random": ("dsv41", "block", "random"),
    "llama-fa-layer-consecutive": ("llama-flash-attn", "layer", "consecutive"),
    "llama-fa-layer-random": ("llama-flash-attn", "layer", "random"),
    "llama-fi-layer-consecutive": ("llama-flashinfer", "layer", "consecutive"),
}


class Setup:
    """Device buffers of one layout and a pinned pool for ``inflight`` requests."""

    def __init__(
        self, model: str, placement: str, order: str, inflight: int, d2d: bool = False
    ) -> None:
        args = GeometryArgs(model=model, placement=placement)
        probe = args.build(1)
        bpc = max(blocks_per_chunk(g, 256) for g in probe.groups if g.cached)
        self.geo = args.build(inflight * CHUNKS * bpc)
        self.layout = build_layout(self.geo.groups, 256, separate=True)
        self.bufs = [cupy.cuda.memory.alloc(s) for s in self.geo.buffer_sizes]
        for b, s in zip(self.bufs, self.geo.buffer_sizes, strict=True):
            cupy.cuda.runtime.memset(int(b.ptr), 0x5A, s)
        per_req = sum(og.object_bytes for og in self.layout.object_groups) * CHUNKS
        self.pool_bytes = inflight * per_req
        self.pool = cupy.cuda.alloc_pinned_memory(self.pool_bytes)
        self.region = self._region(int(self.pool.ptr))
        self.dev_pool = cupy.cuda.memory.alloc(self.pool_bytes) if d2d else None
        rng = np.random.default_rng(1)
        self.plans: list[DmaPlan] = []
        self.plans_d2d: list[DmaPlan] = []
        self.plan_ms = 0.0
        for r in range(inflight):
            copies: list[RunCopy] = []
            base = r * per_req
            for og in self.layout.object_groups:
                offs = (base + np.arange(CHUNKS) * og.object_bytes).astype(np.int64)
                base += CHUNKS * og.object_bytes
                for s in og.sections:
                    g = self.geo.groups[s.group_index]
                    n = blocks_per_chunk(g, 256)
                    ids = np.arange(r * CHUNKS * n, (r + 1) * CHUNKS * n)
                    if order == "random":
                        ids = rng.permutation(ids)
                    gids = ids.reshape(CHUNKS, n)
                    copies += plan_copies(s, section_block_ids(s, gids), offs)
            t0 = time.perf_counter()
            self.plans.append(plan_dma(copies, self.region))
            self.plan_ms = (time.perf_counter() - t0) * 1e3
            if self.dev_pool is not None:
                self.plans_d2d.append(plan_dma(copies, self._region(int(self.dev_pool.ptr))))
        self.dev_scratch = cupy.cuda.memory.alloc(self.plans[0].nbytes)

    def _region(self, pool: int) -> Region:
        return Region(
            np.asarray([int(b.ptr) for b in self.bufs], np.int64),
            np.asarray(self.geo.buffer_sizes, np.int64),
            np.asarray([pool], np.int64),
            self.pool_bytes,
            self.pool_bytes,
        )

    def rows_info(self) -> dict[str, Any]:
        rows = self.plans[0].rows
        one = rows[:, HEIGHT] == 1
        return {
            "bytes": self.plans[0].nbytes,
            "rows_1d": int(one.sum()),
            "rows_2d": int((~one).sum()),
            "mean_row_bytes": float(rows[:, WIDTH].mean()),
            "mean_height_2d": float(rows[~one, HEIGHT].mean()) if (~one).any() else 0.0,
            "plan_ms": self.plan_ms,
        }

    def close(self) -> None:
        self.bufs.clear()
        self.pool = None  # type: ignore[assignment]


class Loop:
    """Requests of one method kept in flight on ``inflight`` lanes, on a thread."""

    def __init__(
        self, setup: Setup, method: str, to_pool: bool, inflight: int, lanes: list[Lane]
    ) -> None:
        self.setup, self.method, self.to_pool = setup, method, to_pool
        self.lanes = lanes[:inflight]
        self.stop = threading.Event()
        self.done = 0
        self.issue_s: list[float] = []
        self.wall = 0.0
        full = batch_copier(0)
        if method == "cur":
            self.copier: BatchCopier | None = None
            if full is not None:  # the 1-D batch alone, 2-D rows as single copies
                self.copier = BatchCopier(ctypes.CDLL("libcuda.so.1"))
        else:
            self.copier = full
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _issue(self, k: int) -> None:
        lane = self.lanes[k]
        t0 = time.perf_counter()
        if self.method == "raw":
            n = self.setup.plans[k].nbytes
            pool = int(self.setup.region.slab_ptrs[0]) + k * n
            dev = int(self.setup.dev_scratch.ptr)
            dst, src = (pool, dev) if self.to_pool else (dev, pool)
            cupy.cuda.runtime.memcpyAsync(dst, src, n, 4, lane.dma.ptr)
        else:
            plans = self.setup.plans_d2d if self.method == "d2d" else self.setup.plans
            issue_dma(lane, plans[k], self.to_pool, self.copier, 4 << 20)
        lane.done.record(lane.dma)
        self.issue_s.append(time.perf_counter() - t0)

    def _run(self) -> None:
        with cupy.cuda.Device(0):
            t0 = time.perf_counter()
            for k in range(len(self.lanes)):
                self._issue(k)
            while not self.stop.is_set():
                for k, lane in enumerate(self.lanes):
                    lane.done.synchronize()
                    self.done += 1
                    self._issue(k)
            for lane in self.lanes:
                lane.done.synchronize()
                self.done += 1
            self.wall = time.perf_counter() - t0

    def gbps(self) -> float:
        return self.done * self.setup.plans[0].nbytes / self.wall / 1e9 if self.wall else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--engines", default="idle,hbm,gemm")
    ap.add_argument("--methods", default="raw,cur,b1,b4,b8")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json", default="")
    ap.add_argument("--d2d", default="", help="layouts that also measure method d2d")
    a = ap.parse_args()
    engine = JsonLineProcess("lmc_server.bench.interference.engine", "engine", {"device": 0})
    gpu = engine.recv(300)["gpu"]
    by_streams = {
        m: [Lane(0, dma_streams=int(m[1:]) if m.startswith("b") else 1) for _ in range(2)]
        for m in a.methods.split(",")
    }
    by_streams["d2d"] = [Lane(0, dma_streams=4) for _ in range(2)]
    d2d = set(filter(None, a.d2d.split(",")))
    out: dict[str, Any] = {"gpu": gpu, "chunks": CHUNKS, "points": [], "layouts": {}}
    setups = {}
    for name in a.layouts.split(","):
        model, placement, order = LAYOUTS[name]
        setups[name] = Setup(model, placement, order, 2, d2d=name in d2d)
        out["layouts"][name] = setups[name].rows_info()
        print(name, out["layouts"][name], flush=True)
    for kind in a.engines.split(","):
        if kind == "idle":
            engine.call({"cmd": "pause"}, 60)
            alone = float("nan")
        else:
            engine.call({"cmd": "kind", "kind": kind}, 300)
            alone = engine.call({"cmd": "measure", "seconds": a.seconds}, 60)["throughput"]
        for name, setup in setups.items():
            for to_pool in (True, False):
                for inflight in (1, 2):
                    extra = ["d2d"] if name in d2d else []
                    for method in a.methods.split(",") + extra:
                        loop = Loop(setup, method, to_pool, inflight, by_streams[method])
                        loop.thread.start()
                        time.sleep(0.05)
                        if kind == "idle":
                            time.sleep(a.seconds)
                            busy = float("nan")
                        else:
                            busy = engine.call({"cmd": "measure", "seconds": a.seconds}, 60)[
                                "throughput"
                            ]
                        loop.stop.set()
                        loop.thread.join(60)
                        p = {
                            "engine": kind,
                            "layout": name,
                            "op": "store" if to_pool else "load",
                            "inflight": inflight,
                            "method": method,
                            "gbps": loop.gbps(),
                            "issue_ms": 1e3 * float(np.median(loop.issue_s)),
                            "engine_loss": 1 - busy / alone if kind != "idle" else float("nan"),
                        }
                        out["points"].append(p)
        if kind != "idle":
            after = engine.call({"cmd": "measure", "seconds": a.seconds}, 60)["throughput"]
            out.setdefault("engine_alone", {})[kind] = [alone, after]
    engine.call({"cmd": "pause"}, 60)
    engine.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    methods = a.methods.split(",")
    print("method:GB/s (engine loss %); issue ms per request (not raw)")
    for kind in a.engines.split(","):
        for name in setups:
            for op in ("store", "load"):
                for k in (1, 2):
                    pts = {
                        p["method"]: p
                        for p in out["points"]
                        if (p["engine"], p["layout"], p["op"], p["inflight"]) == (kind, name, op, k)
                    }
                    shown = [m for m in methods + ["d2d"] if m in pts]
                    cells = " ".join(
                        f"{m}:{pts[m]['gbps']:5.1f}({100 * pts[m]['engine_loss']:4.1f})"
                        for m in shown
                    )
                    issue = "/".join(f"{pts[m]['issue_ms']:.2f}" for m in shown if m != "raw")
                    print(f"{kind:5} {name:27} {op:5} x{k} {cells} {issue}")


if __name__ == "__main__":
    main()
