"""The CUDA engine in this process against buffers exported by a worker process.

Both copy modes, both DeepSeek-V4.1 record formats (the engine never looks at record
bytes, so SM100's 528-byte records are exercised here on any GPU; through the server
they need an SM100 device, which registration enforces), padded block strides that
force the 8-byte and the byte-wise kernel paths, refusal of out-of-range blocks before
any copy. ``test_engine_benchmark`` measures (never asserts) 1/16/64-chunk batches against
a raw pinned copy (``$LMC_BENCH_OUT/engine.json`` when that is set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from lmc_server.buffers import CudaIpcBuffer
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.layout import (
    LayerRun,
    RunCopy,
    build_layout,
    plan_copies,
    section_block_ids,
)
from lmc_server.testing.presets import KVGeometry, dsv41_flash, llama3_8b
from lmc_server.transfer.base import TransferError
from lmc_server.transfer.cpu import _copy_run

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("cuda_worker.py")
SLAB = 64 << 20


class Exported:
    """A worker process holding filled buffers until :meth:`close`."""

    def __init__(
        self,
        arch: str,
        pad: int,
        num_blocks: int,
        layers: int,
        placement: str = "layer",
        model: str = "dsv41",
    ) -> None:
        self.placement, self.pad, self.model = placement, pad, model
        if model == "dsv41":
            self.geo: KVGeometry = dsv41_flash(
                arch=arch, num_blocks=num_blocks, layers=layers, stride_pad=pad, placement=placement
            )
        else:
            backend = {"llama-flash-attn": "flash_attn", "llama-flashinfer": "flashinfer"}[model]
            self.geo = llama3_8b(
                arch=arch,
                num_blocks=num_blocks,
                layers=layers,
                backend=backend,
                placement=placement,
            )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                json.dumps(
                    {
                        "mode": "export",
                        "arch": arch,
                        "stride_pad": pad,
                        "num_blocks": num_blocks,
                        "layers": layers,
                        "placement": placement,
                        "model": model,
                    }
                ),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "worker exited before exporting"
        self.buffers = msgspec.json.decode(line, type=list[CudaIpcBuffer])

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()


def make_engine(
    mode: str, pool_bytes: int, pinning: str = "alloc", kernel_pct: Any = None, **kwargs: Any
) -> tuple[Any, Any]:
    from lmc_server.transfer.cuda.engine import CudaEngine

    engine = CudaEngine(copy_mode=mode, pinning=pinning, kernel_pct=kernel_pct, **kwargs)
    pool = engine.create_pool(pool_bytes, SLAB)
    done = threading.Event()
    ready: list[int] = []

    def on_ready(slab: int) -> None:
        ready.append(slab)
        if len(ready) == pool.n_slabs:
            done.set()

    pool.start(on_ready)
    assert done.wait(120), "pool not pinned in time"
    return engine, pool


def read_buffers(mapping: Any) -> list[np.ndarray]:
    import cupy

    out = []
    for ptr, size in zip(mapping.ptrs.tolist(), mapping.sizes.tolist(), strict=True):
        mem = cupy.cuda.UnownedMemory(ptr, size, None)
        out.append(cupy.ndarray((size,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0)).get())
    return out


def write_buffers(mapping: Any, value: int) -> None:
    import cupy

    for ptr, size in zip(mapping.ptrs.tolist(), mapping.sizes.tolist(), strict=True):
        cupy.cuda.runtime.memset(ptr, value, size)
    cupy.cuda.runtime.deviceSynchronize()


def batch(
    geo: KVGeometry,
    n: int,
    rng: np.random.Generator,
    exclude: dict[str, np.ndarray] | None = None,
    consecutive: bool = False,
) -> tuple[list[RunCopy], dict[str, np.ndarray]]:
    """Copies for ``n`` chunks: object group ``i`` in slabs from ``4 * i``, random blocks
    (or the lowest free ones in order, as a fresh engine hands them out)."""
    layout = build_layout(geo.groups, 256, separate=True)
    copies: list[RunCopy] = []
    used: dict[str, np.ndarray] = {}
    for oi, og in enumerate(layout.object_groups):
        per = SLAB // og.object_bytes
        c = np.arange(n)
        offs = ((4 * oi + c // per) * SLAB + (c % per) * og.object_bytes).astype(np.int64)
        for s in og.sections:
            g = geo.groups[s.group_index]
            bpc = blocks_per_chunk(g, 256)
            pool = np.arange(g.num_blocks)
            if exclude is not None:
                pool = np.setdiff1d(pool, exclude[g.name])
            gids = (pool if consecutive else rng.permutation(pool))[: n * bpc].reshape(n, bpc)
            used[g.name] = gids.ravel()
            copies += plan_copies(s, section_block_ids(s, gids), offs)
    return copies, used


CASES = [
    ("sm90", 0, "layer", "dsv41"),
    ("sm100", 0, "layer", "dsv41"),
    ("sm90", 72, "layer", "dsv41"),
    ("sm100", 13, "layer", "dsv41"),
    ("sm90", 0, "block", "dsv41"),
    ("sm100", 0, "block", "dsv41"),
    ("sm90", 72, "block", "dsv41"),
    ("sm90", 0, "layer", "llama-flash-attn"),
    ("sm90", 0, "layer", "llama-flashinfer"),
    ("sm90", 0, "block", "llama-flash-attn"),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{a}-pad{p}-{pl}" for a, p, pl, m in CASES])
def exported(request: pytest.FixtureRequest) -> Iterator[Exported]:
    arch, pad, placement, model = request.param
    if model == "dsv41":
        e = Exported(arch, pad, num_blocks=96, layers=8, placement=placement)
    else:  # 16 blocks a chunk: two disjoint 6-chunk batches
        e = Exported(arch, pad, num_blocks=200, layers=4, placement=placement, model=model)
    yield e
    e.close()


class RefusingCopier:
    """A batch copier whose every call the driver refuses (as the H200's did for a few
    calls of a DP run), 1-D and 2-D: the engine must issue the same rows as single
    copies."""

    has_2d = True

    def __init__(self) -> None:
        self.calls = 0

    def prepare(self, *_: object) -> object:
        return object()

    def prepare2d(self, *_: object) -> object:
        return object()

    def copy_prepared(self, *_: object) -> None:
        from lmc_server.transfer.base import TransferError

        self.calls += 1
        raise TransferError("cuMemcpyBatchAsync of n copies failed (CUresult 1)")

    def copy2d_prepared(self, *_: object) -> None:
        from lmc_server.transfer.base import TransferError

        self.calls += 1
        raise TransferError("cuMemcpy3DBatchAsync of n 2-D copies failed (CUresult 1)")


@pytest.mark.parametrize(
    "mode",
    [
        "staging",
        "staging-pieces",
        "mapped",
        "dma-single",
        "dma-batch",
        "dma-streams",
        "dma-consecutive",
        "dma-refused",
        "auto-busy",
        "auto-idle",
    ],
)
def test_engine_roundtrip_byte_exact(exported: Exported, mode: str) -> None:
    """Every path byte-exact; ``staging-pieces`` cuts a request into many staging
    pieces (kernel launches at unit rows past the first); ``dma-streams`` spreads one
    request over eight DMA streams; ``dma-consecutive`` takes consecutive block ids
    (pages of a layer copied as one 2-D copy per layer); ``auto`` takes the copy engines
    while the (fake) kernel time says busy, and while it says idle for wide blocks only
    (staging otherwise)."""
    name, _, variant = mode.partition("-")
    pct = {"busy": 95, "idle": 0}.get(variant)
    small: dict[str, Any] = (
        {"first_piece_bytes": 64 << 10, "staging_half_bytes": 1 << 20}
        if variant == "pieces"
        else {}
    )
    if variant == "single":  # one driver call per row
        small["batch_copies"] = False
    if variant == "streams":  # every request cut into slices of 64 KiB and more
        small.update(dma_streams=8, dma_split_bytes=64 << 10)
    refusing = RefusingCopier()
    if variant == "refused":  # every batch refused: single copies instead
        small["make_batch_copier"] = lambda _device: refusing
    engine, pool = make_engine(
        name, 8 * SLAB, kernel_pct=(lambda _d: lambda: pct) if pct is not None else None, **small
    )
    engine.profile = variant == "pieces"
    activity = variant if pct is not None else ""
    mapping = engine.open(exported.buffers)
    try:
        rng = np.random.default_rng(42)
        src = read_buffers(mapping)
        consecutive = variant == "consecutive"
        copies, used = batch(exported.geo, 6, rng, consecutive=consecutive)
        engine.store(mapping, copies)
        if variant == "pieces":
            assert engine.last_profile["pieces"] > 2
        expect_pool = np.zeros(pool.size_bytes, np.uint8)
        for c in copies:
            _copy_run(c, src[c.run.buffer], expect_pool, True)
        got_pool = np.frombuffer(pool.read(0, pool.size_bytes), np.uint8)
        for c in copies:
            for off in c.object_offsets.tolist():
                a, b = off, off + c.run.nbytes
                assert np.array_equal(got_pool[a:b], expect_pool[a:b]), "store differs"
        # Retrieve into other blocks, some of them marked -1 (left alone).
        other, _ = batch(
            exported.geo, 6, np.random.default_rng(43), exclude=used, consecutive=consecutive
        )
        retrieve = []
        for c, o in zip(copies, other, strict=True):
            assert o.run == c.run
            ids = o.block_ids.copy()
            ids[rng.random(ids.shape) < 0.15] = -1
            retrieve.append(RunCopy(c.run, ids, c.object_offsets))
        write_buffers(mapping, 0xEE)
        engine.retrieve(mapping, retrieve)
        expect = [np.full(s, 0xEE, np.uint8) for s in mapping.sizes.tolist()]
        for c in retrieve:
            _copy_run(c, expect[c.run.buffer], got_pool, False)
        got = read_buffers(mapping)
        for i, (g, e) in enumerate(zip(got, expect, strict=True)):
            assert np.array_equal(g, e), f"buffer {i} differs after retrieve"
        if variant == "refused":  # every refused call went out as single copies
            assert engine.batch_fallbacks == refusing.calls
            if exported.placement == "block" and exported.pad == 0:  # 1-D rows
                assert refusing.calls >= 2
        if variant == "streams":
            assert engine.dma_streams_used > 1
        if name == "dma":  # the retrieve's plan is kept for reuse, the store's never
            assert engine.dma_plans_made == 1
        if activity:
            paths = {k for k, v in engine.copies_by_path.items() if v}
            # idle: the copy engines too where a block is one wide range on both sides
            # (256 KiB in the Llama-like block-outermost case; the 8-layer DSV4.1
            # preset's blocks are 17-76 KB ranges, narrow)
            wide = exported.placement == "block" and exported.pad == 0 and exported.model != "dsv41"
            assert paths == {"dma" if activity == "busy" or wide else "staging"}
    finally:
        mapping.close()
        engine.close()


def test_stop_queued_fails_waiting_copies_only(exported: Exported) -> None:
    """Past the drain timeout the copies waiting for a lane fail at once; the copy on
    the lane completes, and a copy submitted afterwards that would wait fails too."""
    from lmc_server.transfer.cuda.engine import CudaEngine

    engine = CudaEngine(copy_mode="staging", lanes_per_device=1)
    pool = engine.create_pool(8 * SLAB, SLAB)
    ready = threading.Event()
    pool.start(lambda slab: ready.set() if slab == pool.n_slabs - 1 else None)
    assert ready.wait(120)
    mapping = engine.open(exported.buffers)
    try:
        copies, _ = batch(exported.geo, 6, np.random.default_rng(2))
        results: list[str] = []
        done = threading.Semaphore(0)

        def report(err: str) -> None:
            results.append(err)
            done.release()

        # the first takes the only lane for milliseconds (the same objects 64 times over)
        engine.submit(mapping, copies * 64, True, report)
        engine.submit(mapping, copies, True, report)  # waits for it
        engine.stop_queued()
        engine.submit(mapping, copies, True, report)  # would wait: refused
        for _ in range(3):
            assert done.acquire(timeout=60)
        assert sorted(bool(r) for r in results) == [False, True, True]
        assert all("shutting down" in r for r in results if r)
    finally:
        mapping.close()
        engine.close()


def test_batch_copies_pass_their_check_on_this_driver() -> None:
    """The driver of the GPU machine has cuMemcpyBatchAsync and copies right with it
    (the engine falls back to single copies elsewhere)."""
    from lmc_server.transfer.cuda.batch import batch_copier

    copier = batch_copier(0)
    assert copier is not None
    assert copier.has_2d  # cuMemcpy3DBatchAsync passed its pitched-copy check


def test_a_device_is_prepared_when_a_mapping_opens_not_at_its_first_copy() -> None:
    """The batch copier's self-check (and the lanes) run once, when the first mapping
    of a device opens: the first request does not pay them, later mappings do not
    repeat them, and the copies then use the copier that was checked."""
    from lmc_server.transfer.cuda.batch import batch_copier

    made: list[int] = []

    def counting(device: int) -> Any:
        made.append(device)
        return batch_copier(device)

    engine, _pool = make_engine("dma", 8 * SLAB, make_batch_copier=counting)
    e = Exported("sm90", 0, num_blocks=96, layers=2)
    try:
        mapping = engine.open(e.buffers)
        assert made == [0], "the device was not prepared at open"
        again = engine.open(e.buffers)
        copies, _ = batch(e.geo, 2, np.random.default_rng(5))
        engine.store(mapping, copies)
        engine.retrieve(again, copies)
        assert made == [0], "a copy or a second mapping checked the copier again"
        again.close()
        mapping.close()
    finally:
        engine.close()
        e.close()


def test_nvml_reads_this_gpu() -> None:
    """The real reader finds this GPU by its PCI bus id and answers a percentage."""
    import cupy

    from lmc_server.transfer.cuda.gpu_activity import NvmlUtilization

    pct = NvmlUtilization(str(cupy.cuda.Device(0).pci_bus_id)).read()
    assert pct is not None and 0 <= pct <= 100


def first_block_past(run: LayerRun, buffer_bytes: int) -> int:
    """The smallest block id whose pages in ``run`` end past ``buffer_bytes``."""
    top = run.base_offset + max(0, (run.n_layers - 1) * run.layer_stride) + run.page_bytes
    return max(0, -(-(buffer_bytes - top + 1) // run.block_stride))


@pytest.mark.parametrize("mode", ["staging", "dma"])
def test_engine_refuses_out_of_range_before_copy(exported: Exported, mode: str) -> None:
    engine, pool = make_engine(mode, 8 * SLAB)
    mapping = engine.open(exported.buffers)
    try:
        copies, _ = batch(exported.geo, 2, np.random.default_rng(1))
        write_buffers(mapping, 0x11)
        engine.store(mapping, copies)
        before = pool.read(0, pool.size_bytes)
        bufs_before = read_buffers(mapping)
        bad = list(copies)
        ids = bad[-1].block_ids.copy()
        # the first block whose pages end past its buffer (the engine's own bound;
        # ids past the group's block count but inside the buffer, as the V plane of
        # FlashAttention's layout after its K plane, are the server's check)
        run = bad[-1].run
        ids[-1, -1] = first_block_past(run, exported.buffers[run.buffer].size_bytes)
        bad[-1] = RunCopy(bad[-1].run, ids, bad[-1].object_offsets)
        write_buffers(mapping, 0x22)
        with pytest.raises(TransferError):
            engine.store(mapping, bad)
        assert pool.read(0, pool.size_bytes) == before, "a refused store copied bytes"
        write_buffers(mapping, 0x11)
        with pytest.raises(TransferError):
            engine.retrieve(mapping, bad)
        after = read_buffers(mapping)
        for a, b in zip(after, bufs_before, strict=True):
            assert np.array_equal(a, b), "a refused retrieve copied bytes"
    finally:
        mapping.close()
        engine.close()


def test_mapping_released_on_close(exported: Exported) -> None:
    engine, _ = make_engine("staging", 2 * SLAB)
    try:
        m1 = engine.open(exported.buffers)
        m2 = engine.open(exported.buffers)  # same allocations: shared, counted
        assert engine.open_handles > 0
        m1.close()
        assert engine.open_handles > 0
        m2.close()
        m2.close()
        assert engine.open_handles == 0
    finally:
        engine.close()


def _timed(fn: Callable[[], object], iters: int) -> float:
    """Median wall seconds of one call after two warm-ups (one slow outlier on a shared
    host must not decide the figure: a mean of 10 once reported 0.39 for a 0.9 path)."""
    fn()  # warm-up
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _profiled(engine: Any, fn: Callable[[], None], iters: int) -> dict[str, float]:
    """Mean of the engine's per-copy breakdown (host planning, enqueue, GPU span)."""
    engine.profile = True
    try:
        fn()
        rows = []
        for _ in range(iters):
            fn()
            rows.append(dict(engine.last_profile))
    finally:
        engine.profile = False
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _gather_ms(engine: Any, mapping: Any, copies: list[RunCopy]) -> float:
    """GPU time of the staging gather kernels alone for one batch (the SM cost)."""
    import cupy

    from lmc_server.transfer.cuda import kernels
    from lmc_server.transfer.cuda.lanes import Lane
    from lmc_server.transfer.cuda.launch import _blocks
    from lmc_server.transfer.cuda.plan import plan_staging

    engine._lanes_of(mapping.device_index)  # the device's SM count
    lane = Lane(mapping.device_index)  # a lane of its own, outside the engine's pool
    with cupy.cuda.Device(mapping.device_index):
        halves = lane.halves(max(c.run.nbytes for c in copies))
        plan = plan_staging(copies, engine._region(mapping), halves, lane.half_bytes)
        units, ids = lane.upload(plan, lane.sm)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(lane.sm)
        for p in plan.pieces:
            kernels.launch(
                lane.device,
                "gather_units",
                units,
                ids,
                plan.n_units,
                p.first,
                p.count,
                plan.max_layers,
                plan.max_blocks,
                _blocks(plan.box_pages(p.count), engine._sm_count[lane.device]),
                256,
                lane.sm,
            )
        end.record(lane.sm)
        end.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, end))


def _pool_dma_gbps(pool: Any, nbytes: int) -> tuple[float, float]:
    """Plain DMAs between one device buffer and the pool's slabs (no kernels, no plan)."""
    import cupy

    rates = []
    with cupy.cuda.Device(0):
        dev = cupy.cuda.memory.Memory(nbytes)
        stream = cupy.cuda.Stream(non_blocking=True)
        for d2h in (True, False):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            for it in range(3):
                if it == 1:
                    start.record(stream)
                done = 0
                for slab in range(pool.n_slabs):
                    n = min(pool.slab_bytes, nbytes - done)
                    if n <= 0:
                        break
                    src, dst = int(dev.ptr) + done, int(pool.slab_ptrs[slab])
                    if not d2h:
                        src, dst = dst, src
                    cupy.cuda.runtime.memcpyAsync(dst, src, n, 4, stream.ptr)
                    done += n
            end.record(stream)
            end.synchronize()
            rates.append(2 * nbytes / (cupy.cuda.get_elapsed_time(start, end) / 1e3) / 1e9)
    return rates[0], rates[1]


#: (name, copy mode, mapped thread blocks, wait mode) measured by the benchmark.
BENCH_CONFIGS = [
    ("staging", "staging", 0, "hybrid"),
    ("mapped64", "mapped", 64, "hybrid"),
    ("dma", "dma", 0, "hybrid"),
]
BENCH_CHUNKS = (1, 16, 64)


def test_engine_benchmark() -> None:
    """Store and retrieve of 1-, 16- and 64-chunk DSV4.1 batches against a raw pinned copy.

    A measurement, not a check: speed is reported (``$LMC_BENCH_OUT/engine.json`` and
    the test output), never asserted. Wall time of ``engine.store``/``engine.retrieve``
    (planning, launches and the wait included), 10 iterations after 2 warm-ups; the
    breakdown comes from separate profiled iterations.
    """
    from lmc_server.testing.cuda_kv import device_arch, raw_copy_gbps
    from lmc_server.transfer.cuda.engine import CudaEngine

    e = Exported(device_arch(0), 0, num_blocks=1100, layers=44, placement="block")
    results: dict[str, Any] = {}
    try:
        for name, mode, blocks, wait in BENCH_CONFIGS:
            engine, pool = make_engine(mode, 16 * SLAB)
            assert isinstance(engine, CudaEngine)
            engine.wait = wait
            if blocks:
                engine.mapped_blocks = blocks
            mapping = engine.open(e.buffers)
            try:
                full, _ = batch(e.geo, 64, np.random.default_rng(0))
                by_size: dict[str, Any] = {}
                for n in BENCH_CHUNKS:
                    copies = [RunCopy(c.run, c.block_ids[:n], c.object_offsets[:n]) for c in full]
                    nbytes = sum(c.nbytes for c in copies)
                    store = partial(engine.store, mapping, copies)
                    retrieve = partial(engine.retrieve, mapping, copies)
                    store_s, retrieve_s = _timed(store, 10), _timed(retrieve, 10)
                    by_size[str(n)] = {
                        "chunks": n,
                        "bytes": nbytes,
                        "store_gbps": nbytes / store_s / 1e9,
                        "retrieve_gbps": nbytes / retrieve_s / 1e9,
                        "store_ms": store_s * 1e3,
                        "retrieve_ms": retrieve_s * 1e3,
                        "store_profile": _profiled(engine, store, 5),
                        "retrieve_profile": _profiled(engine, retrieve, 5),
                    }
                r: dict[str, Any] = {"mode": mode, "wait": wait, "chunks": by_size}
                if name == "staging":
                    from lmc_server.transfer.cuda.plan import plan_staging

                    nbytes = sum(c.nbytes for c in full)
                    r["pool_dma_d2h_gbps"], r["pool_dma_h2d_gbps"] = _pool_dma_gbps(pool, nbytes)
                    r["gather_kernel_ms"] = _gather_ms(engine, mapping, full)
                    r["plan_64_ms"] = 1e3 * _timed(
                        partial(
                            plan_staging,
                            full,
                            engine._region(mapping),  # type: ignore[arg-type]  # a CudaMapping
                            (1 << 50, 1 << 51),
                            32 << 20,
                            8 << 20,
                        ),
                        20,
                    )
                    with ThreadPoolExecutor(4) as ex:  # 4 concurrent 16-chunk stores
                        quarter = [
                            RunCopy(c.run, c.block_ids[q::4], c.object_offsets[q::4])
                            for q in range(4)
                            for c in full
                        ]
                        parts = [quarter[q::4] for q in range(4)]
                        list(ex.map(partial(engine.store, mapping), parts))
                        t0 = time.perf_counter()
                        for _ in range(5):
                            list(ex.map(partial(engine.store, mapping), parts))
                        r["store_4x16_concurrent_gbps"] = (
                            5 * nbytes / (time.perf_counter() - t0) / 1e9
                        )
                results[name] = r
            finally:
                mapping.close()
                engine.close()
        raw: dict[str, Any] = {}
        for n in BENCH_CHUNKS:
            nbytes = int(results["staging"]["chunks"][str(n)]["bytes"])
            raw[str(n)] = {d: raw_copy_gbps(nbytes, d, 0, 10) for d in ("d2h", "h2d", "both")}
        results["raw"] = raw
        for name, r in results.items():
            if name == "raw":
                continue
            for n, row in r["chunks"].items():
                row["store_ratio"] = row["store_gbps"] / raw[n]["d2h"]
                row["retrieve_ratio"] = row["retrieve_gbps"] / raw[n]["h2d"]
    finally:
        e.close()
    out = os.environ.get("LMC_BENCH_OUT")
    if out:
        Path(out, "engine.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    summary = {
        name: {
            n: (round(row["store_ratio"], 3), round(row["retrieve_ratio"], 3))
            for n, row in r["chunks"].items()
        }
        for name, r in results.items()
        if name != "raw"
    }
    print("store/retrieve ratio to raw, by chunks:", json.dumps(summary))
