"""DMA plans moved to another worker's buffers, executed on a simulated address space.

Two workers register the same geometry in buffers at different addresses; the server
plans their shared copy list once (:class:`~lmc_server.transfer.cuda.dma_reuse.DmaPlans`)
and moves the rows to the second worker's buffers. Every row is executed on one numpy
"memory" and the result compared byte for byte with the CPU engine's reference copy, so
a moved row that lands in the wrong buffer, or outside one, fails. No GPU needed.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.layout import RunCopy, build_layout, plan_copies, section_block_ids
from lmc_server.testing.presets import dsv41_flash
from lmc_server.transfer.cpu import _copy_run
from lmc_server.transfer.cuda.dma_plan import DmaPlan
from lmc_server.transfer.cuda.dma_reuse import DmaPlans
from lmc_server.transfer.cuda.units import Region

SLAB = 16 << 20


def copies_of(
    placement: str, n: int, rng: np.random.Generator
) -> tuple[list[RunCopy], list[int], int]:
    geo = dsv41_flash(num_blocks=96, layers=8, placement=placement)
    layout = build_layout(geo.groups, 256, separate=True)
    copies: list[RunCopy] = []
    for slab, og in enumerate(layout.object_groups):
        slots = rng.permutation(SLAB // og.object_bytes)[:n]
        offs = (slab * SLAB + slots * og.object_bytes).astype(np.int64)
        for s in og.sections:
            g = geo.groups[s.group_index]
            gids = rng.permutation(g.num_blocks)[: n * blocks_per_chunk(g, 256)]
            copies += plan_copies(s, section_block_ids(s, gids.reshape(n, -1)), offs)
    return copies, geo.buffer_sizes, len(layout.object_groups) * SLAB


class Memory:
    """The buffers of two workers (same sizes, other addresses), then the pool."""

    def __init__(self, sizes: list[int], pool_bytes: int, workers: int = 2) -> None:
        at = 8192
        self.bufs: list[list[int]] = []
        for _ in range(workers):
            self.bufs.append([])
            for s in sizes:
                self.bufs[-1].append(at)
                at += s + 4096 + 48
        self.pool = at
        self.mem = np.zeros(at + pool_bytes, dtype=np.uint8)
        self.sizes = sizes
        self.pool_bytes = pool_bytes

    def region(self, w: int) -> Region:
        slabs = self.pool + np.arange(self.pool_bytes // SLAB, dtype=np.int64) * SLAB
        return Region(
            np.asarray(self.bufs[w], np.int64),
            np.asarray(self.sizes, np.int64),
            slabs,
            self.pool_bytes,
            SLAB,
        )

    def buf(self, w: int, i: int) -> np.ndarray:
        return self.mem[self.bufs[w][i] : self.bufs[w][i] + self.sizes[i]]

    def pool_view(self) -> np.ndarray:
        return self.mem[self.pool : self.pool + self.pool_bytes]

    def run_dma(self, plan: DmaPlan, to_pool: bool) -> None:
        for dev, dpitch, pool, ppitch, width, height in plan.rows.tolist():
            for r in range(height):
                d, p = dev + r * dpitch, pool + r * ppitch
                if to_pool:
                    self.mem[p : p + width] = self.mem[d : d + width]
                else:
                    self.mem[d : d + width] = self.mem[p : p + width]


@pytest.mark.parametrize("placement", ["block", "layer"])
def test_a_moved_plan_reads_and_writes_the_second_workers_pages(placement: str) -> None:
    rng = np.random.default_rng(3)
    copies, sizes, pool_bytes = copies_of(placement, 4, rng)
    mem = Memory(sizes, pool_bytes)
    mem.pool_view()[:] = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
    plans = DmaPlans()
    seen: dict[int, object] = {}
    for w in (0, 1, 0, 1):
        plan = plans.plan(copies, mem.region(w))
        assert seen.setdefault(w, plan) is plan  # each worker's plan is kept for it
        mem.run_dma(plan, to_pool=False)  # a retrieve into worker w
        for i in range(len(sizes)):
            expect = np.zeros(sizes[i], np.uint8)
            for c in copies:
                if c.run.buffer == i:
                    _copy_run(c, expect, mem.pool_view(), False)
            assert np.array_equal(mem.buf(w, i), expect), f"worker {w}, buffer {i}"
        other = 1 - w
        assert not any(mem.buf(other, i).any() for i in range(len(sizes))), "wrote elsewhere"
        for i in range(len(sizes)):
            mem.buf(w, i)[:] = 0
    assert (plans.planned, plans.moved, plans.reused) == (1, 1, 2)


def test_a_moved_store_plan_gathers_the_second_workers_pages() -> None:
    rng = np.random.default_rng(4)
    copies, sizes, pool_bytes = copies_of("block", 3, rng)
    mem = Memory(sizes, pool_bytes)
    for w in (0, 1):
        for i in range(len(sizes)):
            mem.buf(w, i)[:] = rng.integers(0, 256, sizes[i], dtype=np.uint8)
    plans = DmaPlans()
    plans.plan(copies, mem.region(0))
    mem.run_dma(plans.plan(copies, mem.region(1)), to_pool=True)
    expect = np.zeros(pool_bytes, np.uint8)
    for c in copies:
        _copy_run(c, mem.buf(1, c.run.buffer), expect, True)
    assert np.array_equal(mem.pool_view(), expect)


def test_only_the_same_list_with_the_same_sizes_and_pool_is_reused() -> None:
    rng = np.random.default_rng(5)
    copies, sizes, pool_bytes = copies_of("block", 2, rng)
    mem = Memory(sizes, pool_bytes)
    plans = DmaPlans()
    plans.plan(copies, mem.region(0))
    plans.plan(list(copies), mem.region(0))  # equal content, another list: planned
    bigger = mem.region(1)
    bigger = Region(
        bigger.buffer_ptrs,
        bigger.buffer_sizes + 4096,
        bigger.slab_ptrs,
        bigger.pool_bytes,
        bigger.slab_bytes,
    )
    plans.plan(copies, bigger)  # other sizes: planned
    r = mem.region(1)
    moved_pool = Region(r.buffer_ptrs, r.buffer_sizes, r.slab_ptrs + SLAB, r.pool_bytes, SLAB)
    plans.plan(copies, moved_pool)  # other slabs: planned
    assert plans.planned == 4 and plans.moved == 0 and plans.reused == 0
    plans.plan(copies, moved_pool)
    assert plans.reused == 1


def test_overlapping_buffers_are_never_moved() -> None:
    rng = np.random.default_rng(6)
    copies, sizes, pool_bytes = copies_of("block", 2, rng)
    mem = Memory(sizes, pool_bytes)
    r0 = mem.region(0)
    overlap = np.asarray(mem.bufs[0], np.int64)
    overlap[-1] = overlap[0] + 64  # two buffers share addresses
    sizes_arr = np.asarray(sizes, np.int64)
    sizes_arr[-1] = min(sizes_arr[-1], sizes_arr[0] - 64)
    a = Region(overlap, sizes_arr, r0.slab_ptrs, r0.pool_bytes, SLAB)
    b = Region(overlap + 1 << 20, sizes_arr, r0.slab_ptrs, r0.pool_bytes, SLAB)
    keep = [c for c in copies if c.run.buffer != len(sizes) - 1]
    plans = DmaPlans()
    plans.plan(keep, a)
    plans.plan(keep, b)
    assert plans.planned == 2 and plans.moved == 0


def test_plans_are_bounded() -> None:
    rng = np.random.default_rng(7)
    copies, sizes, pool_bytes = copies_of("block", 1, rng)
    mem = Memory(sizes, pool_bytes)
    plans = DmaPlans(size=4)
    keep = [list(copies) for _ in range(10)]
    for c in keep:
        plans.plan(c, mem.region(0))
    assert len(plans._entries) == 4
