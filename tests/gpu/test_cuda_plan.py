"""The CUDA engine's copy plans, executed by numpy on a simulated address space.

Runs on any host (no GPU marker): every kernel launch (emulated slot by slot, with the
index arithmetic of ``kernels/copy_pages.cu``) and every DMA the engine would issue is
applied to one numpy "memory" in which buffers, pool and staging halves sit at their
addresses, and the resulting pool and page bytes are compared with the CPU engine's
reference copy of the same :class:`RunCopy` list.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.layout import RunCopy, build_layout, plan_copies, section_block_ids
from lmc_server.testing.presets import KVGeometry, dsv41_flash, llama3_8b
from lmc_server.transfer.base import TransferError
from lmc_server.transfer.cpu import _copy_run
from lmc_server.transfer.cuda.dma_plan import DmaPlan, plan_dma, split_rows, wide_rows
from lmc_server.transfer.cuda.plan import Plan, plan_mapped, plan_staging
from lmc_server.transfer.cuda.units import Region, plan_units

SLAB = 16 << 20


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two 1-D uint8 arrays, 8 bytes at a time (5x faster on the
    tens of MiB each case compares)."""
    if a.shape != b.shape:
        return False
    n = a.size - a.size % 8
    return np.array_equal(a[:n].view(np.uint64), b[:n].view(np.uint64)) and np.array_equal(
        a[n:], b[n:]
    )


class Memory:
    """Buffers, then the pool, then two staging halves, in one byte array."""

    def __init__(self, sizes: list[int], pool_bytes: int, half_bytes: int) -> None:
        self.bufs = []
        at = 4096
        for s in sizes:
            self.bufs.append(at)
            at += s + 4096 + 16 * 3  # gaps, and an address that is not 4 KiB aligned
        self.pool = at
        at += pool_bytes
        self.halves = [at, at + half_bytes]
        self.mem = np.zeros(at + 2 * half_bytes, dtype=np.uint8)
        slabs = self.pool + np.arange(pool_bytes // SLAB, dtype=np.int64) * SLAB
        self.region = Region(
            np.asarray(self.bufs, np.int64), np.asarray(sizes, np.int64), slabs, pool_bytes, SLAB
        )
        self.sizes = sizes
        self.half_bytes = half_bytes

    def buf(self, i: int) -> np.ndarray:
        return self.mem[self.bufs[i] : self.bufs[i] + self.sizes[i]]

    def pool_view(self) -> np.ndarray:
        return self.mem[self.pool : self.pool + self.region.pool_bytes]

    def run(self, plan: Plan, to_pool: bool) -> None:
        """Each piece as the engine issues it: DMAs in, the kernel, DMAs out."""
        for p in plan.pieces:
            if not to_pool:
                for stage, pool, n in p.segments.tolist():
                    self.mem[stage : stage + n] = self.mem[pool : pool + n]
            self.kernel(plan, p.first, p.count, to_pool)
            if to_pool:
                for stage, pool, n in p.segments.tolist():
                    self.mem[pool : pool + n] = self.mem[stage : stage + n]

    def run_dma(self, plan: DmaPlan, to_pool: bool) -> None:
        """Each 2-D copy the engine issues (``cudaMemcpy2DAsync``), row by row."""
        for dev, dpitch, pool, ppitch, width, height in plan.rows.tolist():
            assert width > 0 and height > 0 and dpitch >= width and ppitch >= width
            for r in range(height):
                d, p = dev + r * dpitch, pool + r * ppitch
                if to_pool:
                    self.mem[p : p + width] = self.mem[d : d + width]
                else:
                    self.mem[d : d + width] = self.mem[p : p + width]

    def kernel(self, plan: Plan, first: int, count: int, to_object: bool) -> None:
        """``copy_units`` of kernels/copy_pages.cu, slot by slot, on this memory."""
        per_unit = plan.max_layers * plan.max_blocks
        rows = plan.units[first : first + count].tolist()
        ids = plan.ids.tolist()
        for k in range(plan.box_pages(count)):
            u, rem = divmod(k, per_unit)
            layer, j = divmod(rem, plan.max_blocks)
            (
                base,
                l_stride,
                b_stride,
                n,
                obj,
                ids_off,
                n_layers,
                n_blocks,
                o_lstride,
                o_bstride,
            ) = rows[u]
            if layer >= n_layers or j >= n_blocks or ids[ids_off + j] < 0:
                continue
            page = base + layer * l_stride + ids[ids_off + j] * b_stride
            o = obj + layer * o_lstride + j * o_bstride
            if to_object:
                self.mem[o : o + n] = self.mem[page : page + n]
            else:
                self.mem[page : page + n] = self.mem[o : o + n]


def dsv41_copies(
    arch: str,
    n_chunks: int,
    stride_pad: int,
    rng: np.random.Generator,
    consecutive: bool = False,
    placement: str = "layer",
) -> tuple[list[RunCopy], list[int], int]:
    """Copies of ``n_chunks`` chunks, block ids random (or consecutive, as a fresh
    engine hands them out), objects in random slots."""
    geo = dsv41_flash(
        arch=arch, num_blocks=128, layers=8, stride_pad=stride_pad, placement=placement
    )
    layout = build_layout(geo.groups, 256, separate=True)
    copies: list[RunCopy] = []
    slots_per_slab = {og.name: SLAB // og.object_bytes for og in layout.object_groups}
    slab = 0
    for og in layout.object_groups:
        slots = rng.permutation(slots_per_slab[og.name])[:n_chunks]
        offs = (slab * SLAB + slots * og.object_bytes).astype(np.int64)
        slab += 1
        for s in og.sections:
            g = geo.groups[s.group_index]
            bpc = blocks_per_chunk(g, 256)
            order = np.arange(g.num_blocks) if consecutive else rng.permutation(g.num_blocks)
            gids = order[: n_chunks * bpc].reshape(n_chunks, bpc)
            copies += plan_copies(s, section_block_ids(s, gids), offs)
    return copies, geo.buffer_sizes, (slab + 1) * SLAB


@pytest.mark.parametrize("placement", ["layer", "block"])
@pytest.mark.parametrize("consecutive", [False, True], ids=["random-ids", "consecutive-ids"])
@pytest.mark.parametrize("mode", ["staging", "mapped", "dma"])
@pytest.mark.parametrize(("arch", "pad"), [("sm90", 0), ("sm100", 0), ("sm90", 72)])
def test_plan_matches_cpu_reference(
    mode: str, arch: str, pad: int, consecutive: bool, placement: str
) -> None:
    rng = np.random.default_rng(7)
    copies, sizes, pool_bytes = dsv41_copies(arch, 5, pad, rng, consecutive, placement)
    mem = Memory(sizes, pool_bytes, half_bytes=1 << 20)
    for i in range(len(sizes)):
        mem.buf(i)[:] = rng.integers(0, 256, sizes[i], dtype=np.uint8)

    def plan() -> Plan | DmaPlan:
        if mode == "mapped":
            return plan_mapped(copies, mem.region)
        if mode == "dma":
            return plan_dma(copies, mem.region)
        return plan_staging(
            copies, mem.region, mem.halves, mem.half_bytes, first_piece_bytes=256 << 10
        )

    def execute(p: Plan | DmaPlan, to_pool: bool) -> None:
        if isinstance(p, DmaPlan):
            mem.run_dma(p, to_pool)
        else:
            mem.run(p, to_pool)

    p = plan()
    assert p.nbytes == sum(c.nbytes for c in copies)
    if isinstance(p, DmaPlan):
        rows = int(p.rows[:, 5].sum())  # 1-D rows the copy engines walk
        if placement == "block" and pad == 0:  # a block's layers: one contiguous copy,
            # and a chunk's consecutive blocks one copy together
            assert (
                rows
                == p.n_rows
                == sum(c.block_ids.shape[0] if consecutive else c.block_ids.size for c in copies)
            )
        else:  # one row per page, a block's layers stacked into one 2-D copy
            assert rows == sum(c.block_ids.size * c.run.n_layers for c in copies)
            assert p.n_rows == sum(c.block_ids.size for c in copies)
    if isinstance(p, Plan) and mode == "staging":
        assert len(p.pieces) > 1  # 1 MiB halves force several pieces
        sizes_of = (p.units[:, 3] * p.units[:, 6] * p.units[:, 7]).tolist()
        fill = [sum(sizes_of[q.first : q.first + q.count]) for q in p.pieces]
        assert fill[0] <= max(256 << 10, sizes_of[0])  # the short first piece
        assert all(f <= mem.half_bytes for f in fill)
        assert [q.first for q in p.pieces] == np.cumsum(
            [0] + [q.count for q in p.pieces[:-1]]
        ).tolist()
        assert sum(q.count for q in p.pieces) == p.n_units
    execute(p, to_pool=True)
    expect_pool = np.zeros(pool_bytes, np.uint8)
    for c in copies:
        _copy_run(c, mem.buf(c.run.buffer), expect_pool, True)
    assert same_bytes(mem.pool_view(), expect_pool)

    # Retrieve into fresh buffers, with some blocks marked "leave alone" (-1).
    originals = [mem.buf(i).copy() for i in range(len(sizes))]
    for i in range(len(sizes)):
        mem.buf(i)[:] = 0xEE
    holed = [
        RunCopy(
            c.run, np.where(rng.random(c.block_ids.shape) < 0.2, -1, c.block_ids), c.object_offsets
        )
        for c in copies
    ]
    copies[:] = holed
    execute(plan(), to_pool=False)
    expect = [np.full(s, 0xEE, np.uint8) for s in sizes]
    for c in holed:
        _copy_run(c, expect[c.run.buffer], mem.pool_view(), False)
    for i in range(len(sizes)):
        assert same_bytes(mem.buf(i), expect[i])
        touched = expect[i] != 0xEE
        assert np.array_equal(mem.buf(i)[touched], originals[i][touched])


def test_out_of_range_block_refused() -> None:
    rng = np.random.default_rng(1)
    copies, sizes, pool_bytes = dsv41_copies("sm90", 2, 0, rng)
    mem = Memory(sizes, pool_bytes, 1 << 20)
    c = copies[0]
    ids = c.block_ids.copy()
    ids[0, 0] = 128  # num_blocks is 128: one past the last block
    bad = [RunCopy(c.run, ids, c.object_offsets)]
    with pytest.raises(TransferError, match="buffer"):
        plan_staging(bad, mem.region, mem.halves, mem.half_bytes)
    with pytest.raises(TransferError, match="buffer"):
        plan_mapped(bad, mem.region)
    with pytest.raises(TransferError, match="buffer"):
        plan_dma(bad, mem.region)
    ids[0, 0] = -2
    with pytest.raises(TransferError, match="negative"):
        plan_mapped([RunCopy(c.run, ids, c.object_offsets)], mem.region)
    offs = c.object_offsets.copy()
    offs[0] = pool_bytes - 1
    with pytest.raises(TransferError, match="pool"):
        plan_mapped([RunCopy(c.run, c.block_ids, offs)], mem.region)
    with pytest.raises(TransferError, match="pool"):
        plan_dma([RunCopy(c.run, c.block_ids, offs)], mem.region)


def test_adjacent_objects_merge_into_one_dma() -> None:
    rng = np.random.default_rng(3)
    geo = dsv41_flash(num_blocks=64, layers=4)
    layout = build_layout(geo.groups, 256, separate=False)
    og = layout.object_groups[0]
    n = 6
    offs = np.arange(n, dtype=np.int64) * og.object_bytes
    copies: list[RunCopy] = []
    for s in og.sections:
        g = geo.groups[s.group_index]
        bpc = blocks_per_chunk(g, 256)
        gids = rng.permutation(g.num_blocks)[: n * bpc].reshape(n, bpc)
        copies += plan_copies(s, section_block_ids(s, gids), offs)
    mem = Memory(geo.buffer_sizes, SLAB, 8 << 20)
    p = plan_staging(copies, mem.region, mem.halves, mem.half_bytes)
    assert len(p.pieces) == 1
    assert p.pieces[0].segments.tolist() == [[mem.halves[0], mem.pool, n * og.object_bytes]]


def test_plan_uses_its_own_copy_of_the_ids() -> None:
    """The uploaded block ids are the checked ones: later edits of the caller's arrays
    change nothing in a plan."""
    rng = np.random.default_rng(5)
    copies, sizes, pool_bytes = dsv41_copies("sm90", 3, 0, rng)
    mem = Memory(sizes, pool_bytes, 1 << 20)
    p = plan_mapped(copies[:1], mem.region)
    before = p.ids.copy()
    copies[0].block_ids[:] = 10**9
    assert np.array_equal(p.ids, before)


def test_all_holes_copy_is_skipped_and_mixed_runs_share_a_box() -> None:
    rng = np.random.default_rng(9)
    copies, sizes, pool_bytes = dsv41_copies("sm90", 3, 0, rng)
    mem = Memory(sizes, pool_bytes, 1 << 20)
    # A copy with fewer layers and blocks than the others: its slots in the
    # (units, max_layers, max_blocks) box must be skipped, not copied.
    c = copies[0]
    small_run = type(c.run)(
        c.run.buffer,
        c.run.base_offset,
        c.run.layer_stride,
        1,
        c.run.block_stride,
        c.run.page_bytes,
        c.run.object_offset,
        1,
    )
    small = RunCopy(small_run, c.block_ids[:, :1], c.object_offsets)
    holes = RunCopy(copies[1].run, np.full_like(copies[1].block_ids, -1), copies[1].object_offsets)
    plan = plan_staging([small, holes] + copies[2:], mem.region, mem.halves, mem.half_bytes)
    assert plan.n_units == 3 * (len(copies) - 1)
    for i in range(len(sizes)):
        mem.buf(i)[:] = rng.integers(0, 256, sizes[i], dtype=np.uint8)
    mem.run(plan, to_pool=True)
    expect_pool = np.zeros(pool_bytes, np.uint8)
    for cc in [small] + copies[2:]:
        _copy_run(cc, mem.buf(cc.run.buffer), expect_pool, True)
    assert same_bytes(mem.pool_view(), expect_pool)


def test_dma_plan_skips_holes_and_all_hole_copies() -> None:
    """Holes (-1) split runs and are never copied; a copy of holes only adds no row;
    a run whose layers overlap (layer stride below the row width) is issued layer by
    layer."""
    rng = np.random.default_rng(11)
    copies, sizes, pool_bytes = dsv41_copies("sm90", 4, 0, rng, consecutive=True)
    mem = Memory(sizes, pool_bytes, 1 << 20)
    for i in range(len(sizes)):
        mem.buf(i)[:] = rng.integers(0, 256, sizes[i], dtype=np.uint8)
    holes = RunCopy(copies[1].run, np.full_like(copies[1].block_ids, -1), copies[1].object_offsets)
    c = copies[0]
    ids = c.block_ids.copy()
    ids[:, 1] = -1
    holed = RunCopy(c.run, ids, c.object_offsets)
    r = c.run  # the same pages, described as a run with a negative layer stride
    flipped_run = type(r)(
        r.buffer,
        r.base_offset + (r.n_layers - 1) * r.layer_stride,
        -r.layer_stride,
        r.n_layers,
        r.block_stride,
        r.page_bytes,
        r.object_offset,
        r.n_blocks,
    )
    flipped = RunCopy(flipped_run, copies[2].block_ids, copies[2].object_offsets)
    chosen = [holed, holes, flipped] + copies[3:]
    p = plan_dma(chosen, mem.region)
    assert p.nbytes == sum(
        int((cc.block_ids >= 0).sum()) * cc.run.n_layers * cc.run.page_bytes for cc in chosen
    )
    mem.run_dma(p, to_pool=True)
    expect_pool = np.zeros(pool_bytes, np.uint8)
    for cc in chosen:
        _copy_run(cc, mem.buf(cc.run.buffer), expect_pool, True)
    assert same_bytes(mem.pool_view(), expect_pool)
    assert plan_dma([holes], mem.region).n_rows == 0


@pytest.mark.parametrize("mode", ["staging", "mapped", "dma"])
def test_section_of_many_runs_interleaves_block_major(mode: str) -> None:
    """Layers of one group spread over two buffers form runs whose object pages
    interleave (block-major sections); every path still writes exactly the reference
    bytes, and staging keeps a section's runs in one cluster of one piece."""
    from msgspec.structs import replace

    rng = np.random.default_rng(21)
    geo = dsv41_flash(num_blocks=64, layers=8)
    sizes = list(geo.buffer_sizes)
    groups = []
    for g in geo.groups:
        if g.name == "compressed":  # odd layers move to a buffer of their own, in order
            sizes.append(sizes[g.layers[0].buffer])
            extra = len(sizes) - 1
            g = replace(
                g,
                layers=[
                    replace(layer, buffer=extra) if i % 2 else layer
                    for i, layer in enumerate(g.layers)
                ],
            )
        groups.append(g)
    layout = build_layout(groups, 256, separate=True)
    full = layout.object_groups[0]
    comp = next(s for s in full.sections if s.group_name == "compressed")
    assert len(comp.runs) == len(groups[comp.group_index].layers)  # one run per layer
    n = 3
    offs = (np.arange(n, dtype=np.int64) * 2 + 1) * full.object_bytes  # gaps between
    copies: list[RunCopy] = []
    for s in full.sections:
        g = groups[s.group_index]
        bpc = blocks_per_chunk(g, 256)
        gids = rng.permutation(g.num_blocks)[: n * bpc].reshape(n, bpc)
        copies += plan_copies(s, section_block_ids(s, gids), offs)
    pool_bytes = SLAB
    mem = Memory(sizes, pool_bytes, half_bytes=4 << 20)
    for i in range(len(sizes)):
        mem.buf(i)[:] = rng.integers(0, 256, sizes[i], dtype=np.uint8)
    if mode == "dma":
        p: Plan | DmaPlan = plan_dma(copies, mem.region)
        assert isinstance(p, DmaPlan)
        mem.run_dma(p, to_pool=True)
    else:
        p = (
            plan_mapped(copies, mem.region)
            if mode == "mapped"
            else plan_staging(copies, mem.region, mem.halves, mem.half_bytes)
        )
        assert isinstance(p, Plan)
        mem.run(p, to_pool=True)
    expect_pool = np.zeros(pool_bytes, np.uint8)
    for c in copies:
        _copy_run(c, mem.buf(c.run.buffer), expect_pool, True)
    assert same_bytes(mem.pool_view(), expect_pool)
    if mode == "staging":
        assert isinstance(p, Plan)
        # one piece; one DMA per object (its sections are adjacent clusters)
        assert len(p.pieces) == 1 and len(p.pieces[0].segments) == n
        assert sorted(int(x) for q in p.pieces for x in q.segments[:, 2]) == [full.object_bytes] * n


def llama_copies(
    backend: str, placement: str, n_chunks: int, consecutive: bool, rng: np.random.Generator
) -> tuple[list[RunCopy], list[int], int]:
    """Copies of ``n_chunks`` chunks of the Llama-like preset (4 layers), objects in
    random slots of the first slabs."""
    geo = llama3_8b(num_blocks=96, layers=4, backend=backend, placement=placement)
    layout = build_layout(geo.groups, 256, separate=True)
    (og,) = layout.object_groups
    per = SLAB // og.object_bytes
    slots = rng.permutation(per * 2)[:n_chunks]
    offs = ((slots // per) * SLAB + (slots % per) * og.object_bytes).astype(np.int64)
    (s,) = og.sections
    g = geo.groups[s.group_index]
    order = np.arange(g.num_blocks) if consecutive else rng.permutation(g.num_blocks)
    gids = order[: n_chunks * 16].reshape(n_chunks, 16)
    return plan_copies(s, section_block_ids(s, gids), offs), geo.buffer_sizes, 3 * SLAB


@pytest.mark.parametrize("consecutive", [False, True], ids=["random-ids", "consecutive-ids"])
@pytest.mark.parametrize("placement", ["layer", "block"])
@pytest.mark.parametrize("backend", ["flash_attn", "flashinfer"])
def test_llama_dma_plan_matches_cpu_reference(
    backend: str, placement: str, consecutive: bool
) -> None:
    """The Llama-like preset in both backends' shapes, byte-exact both ways against the
    CPU engine; consecutive ids on per-layer tensors take one 2-D copy per layer (and
    plane) and chunk, not one per page."""
    rng = np.random.default_rng(11)
    copies, sizes, pool_bytes = llama_copies(backend, placement, 5, consecutive, rng)
    mem = Memory(sizes, pool_bytes, half_bytes=1 << 20)
    for i in range(len(sizes)):
        mem.buf(i)[:] = rng.integers(0, 256, sizes[i], dtype=np.uint8)
    p = plan_dma(copies, mem.region)
    assert p.nbytes == sum(c.nbytes for c in copies)
    pages = sum(c.block_ids.size * c.run.n_layers for c in copies)
    if placement == "block":  # every layer of a block side by side: a block per row
        assert p.n_rows == (5 if consecutive else 5 * 16)
    elif consecutive:  # a plane's 16 blocks in one 2-D copy
        assert p.n_rows == sum(c.block_ids.shape[0] * c.run.n_layers for c in copies)
        assert (p.rows[:, 5] == 16).all()
    else:
        assert int(p.rows[:, 5].sum()) == pages
    mem.run_dma(p, to_pool=True)
    expect_pool = np.zeros(pool_bytes, np.uint8)
    for c in copies:
        _copy_run(c, mem.buf(c.run.buffer), expect_pool, True)
    assert same_bytes(mem.pool_view(), expect_pool)
    holed = [
        RunCopy(
            c.run, np.where(rng.random(c.block_ids.shape) < 0.2, -1, c.block_ids), c.object_offsets
        )
        for c in copies
    ]
    for i in range(len(sizes)):
        mem.buf(i)[:] = 0xEE
    mem.run_dma(plan_dma(holed, mem.region), to_pool=False)
    expect = [np.full(s, 0xEE, np.uint8) for s in sizes]
    for c in holed:
        _copy_run(c, expect[c.run.buffer], mem.pool_view(), False)
    for i in range(len(sizes)):
        assert same_bytes(mem.buf(i), expect[i])


@pytest.mark.parametrize("holes", [0.0, 0.2], ids=["no-holes", "holes"])
@pytest.mark.parametrize("consecutive", [False, True], ids=["random-ids", "consecutive-ids"])
@pytest.mark.parametrize(
    "preset", ["dsv41-sm90", "dsv41-sm100", "dsv41-padded", "llama-fa", "llama-fi"]
)
def test_side_by_side_plan_is_the_general_plan(
    preset: str, consecutive: bool, holes: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block-outermost pages take the short plan (one row per stored block, joined);
    it must give exactly the rows, in the order, the general plan gives for them. The
    same checks ran first (plan_units, check_objects): only the rows differ in how they
    are worked out."""
    from lmc_server.transfer.cuda import dma_plan

    rng = np.random.default_rng(7)
    if preset.startswith("dsv41"):
        arch = "sm100" if preset == "dsv41-sm100" else "sm90"
        pad = 72 if preset == "dsv41-padded" else 0
        copies, sizes, pool_bytes = dsv41_copies(
            arch, 6, pad, rng, consecutive=consecutive, placement="block"
        )
    else:
        backend = "flash_attn" if preset == "llama-fa" else "flashinfer"
        copies, sizes, pool_bytes = llama_copies(backend, "block", 5, consecutive, rng)
    if holes:
        copies = [
            RunCopy(
                c.run,
                np.where(rng.random(c.block_ids.shape) < holes, -1, c.block_ids),
                c.object_offsets,
            )
            for c in copies
        ]
    mem = Memory(sizes, pool_bytes, 1 << 20)
    calls: list[bool] = []
    real = dma_plan._side_by_side

    def recorded(t: np.ndarray) -> bool:
        calls.append(real(t))
        return calls[-1]

    monkeypatch.setattr(dma_plan, "_side_by_side", recorded)
    short = plan_dma(copies, mem.region)
    monkeypatch.setattr(dma_plan, "_side_by_side", lambda t: False)
    general = plan_dma(copies, mem.region)
    # padded pages (a layer stride past the page) are 2-D copies: the general plan
    assert calls == [preset != "dsv41-padded"]
    assert (
        short.nbytes
        == general.nbytes
        == sum(int((c.block_ids >= 0).sum()) * c.run.n_layers * c.run.page_bytes for c in copies)
    )
    np.testing.assert_array_equal(short.rows, general.rows)


def test_layer_outermost_pages_take_the_general_plan() -> None:
    """A page per layer and block (layer-outermost): 2-D copies, never the short plan."""
    from lmc_server.transfer.cuda import dma_plan

    rng = np.random.default_rng(3)
    copies, sizes, pool_bytes = dsv41_copies("sm90", 2, 0, rng, placement="layer")
    units = plan_units(copies, Memory(sizes, pool_bytes, 1 << 20).region)
    assert units is not None and not dma_plan._side_by_side(units.table)


def test_split_rows_covers_every_row_once_by_bytes() -> None:
    """Slices for the DMA streams: consecutive, every row once, about equal bytes, none
    under the least size, one slice for a small request."""
    rng = np.random.default_rng(3)
    rows = np.zeros((1000, 6), np.int64)
    rows[:, 0] = np.arange(1000)
    rows[:, 4] = rng.integers(1 << 10, 1 << 16, 1000)
    rows[:, 5] = rng.integers(1, 23, 1000)
    total = int((rows[:, 4] * rows[:, 5]).sum())
    for parts in (1, 2, 3, 4, 8):
        got = split_rows(rows, parts, min_bytes=1 << 20)
        assert len(got) == min(parts, total >> 20)
        assert np.array_equal(np.concatenate(got)[:, 0], rows[:, 0])
        sizes = [int((g[:, 4] * g[:, 5]).sum()) for g in got]
        assert max(sizes) - min(sizes) <= 2 * int((rows[:, 4] * rows[:, 5]).max())
    assert len(split_rows(rows, 8, min_bytes=total)) == 1
    assert len(split_rows(rows[:3], 8, min_bytes=1)) == 3
    assert split_rows(rows[:0], 4) == []


def test_wide_rows_weighs_blocks_by_bytes() -> None:
    """``auto``'s idle choice: block-outermost DSV4.1 (44 layers: 418 KB blocks, the
    indexer's 93 KB among them) and block-outermost Llama are wide; layer-outermost
    pages, padded block strides and the 8-layer preset's 76 KB blocks are not."""

    def copies(geo: KVGeometry) -> list[RunCopy]:
        layout = build_layout(geo.groups, 256, separate=True)
        out: list[RunCopy] = []
        for og in layout.object_groups:
            for s in og.sections:
                ids = np.arange(2 * s.n_blocks).reshape(2, s.n_blocks)
                out += plan_copies(s, ids, np.asarray([0, og.object_bytes], np.int64))
        return out

    assert wide_rows(copies(dsv41_flash(num_blocks=64, layers=44, placement="block")))
    assert wide_rows(copies(llama3_8b(num_blocks=64, layers=4, placement="block")))
    assert not wide_rows(copies(dsv41_flash(num_blocks=64, layers=44, placement="layer")))
    assert not wide_rows(
        copies(dsv41_flash(num_blocks=64, layers=44, placement="block", stride_pad=72))
    )
    assert not wide_rows(copies(dsv41_flash(num_blocks=64, layers=8, placement="block")))
    for backend in ("flash_attn", "flashinfer"):
        assert not wide_rows(copies(llama3_8b(num_blocks=64, backend=backend)))
    assert not wide_rows([])
