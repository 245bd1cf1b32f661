"""Registration-time geometry rules: chunk size, record formats, bounds, layouts."""

from __future__ import annotations

import pytest

from lmc_server.cache.geometry import (
    ArchError,
    GeometryError,
    GroupSpec,
    LayerSpec,
    blocks_per_chunk,
    check_groups,
    smallest_chunk_size,
)
from lmc_server.cache.layout import build_layout
from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.testing.presets import dsv41_flash, simple_model


def test_dsv41_preset_passes_at_256_and_every_multiple_of_64() -> None:
    geo = dsv41_flash()
    for chunk in (64, 128, 256, 512):
        check_groups(geo.groups, chunk, "sm90", geo.buffer_sizes)
    assert smallest_chunk_size(geo.groups) == 64


def test_chunk_size_96_refused_naming_group_numbers_and_smallest() -> None:
    geo = dsv41_flash()
    with pytest.raises(GeometryError) as e:
        check_groups(geo.groups, 96, "sm90", geo.buffer_sizes)
    msg = str(e.value)
    assert "'compressed'" in msg and "96" in msg and "64" in msg
    assert "smallest chunk size that works for every cached group is 64" in msg


def test_scratch_group_is_exempt_from_the_chunk_rule() -> None:
    geo = dsv41_flash()
    scratch = next(g for g in geo.groups if g.kind == "scratch")
    odd = GroupSpec(
        **{
            **{f: getattr(scratch, f) for f in scratch.__struct_fields__},
            "tokens_per_block": 7,
            "states_per_block": 7,
        }
    )
    groups = [g if g is not scratch else odd for g in geo.groups]
    check_groups(groups, 256, "sm90", geo.buffer_sizes)


def test_tokens_per_block_must_be_multiple_of_tokens_per_state() -> None:
    geo = simple_model(tokens_per_block=16)
    g = geo.groups[0]
    bad = GroupSpec(
        name="odd",
        kind="full",
        tokens_per_block=16,
        states_per_block=3,
        record_format="bf16",
        bytes_per_state=1024,
        num_blocks=g.num_blocks,
        layers=g.layers,
    )
    with pytest.raises(GeometryError, match="'odd'.*16.*states_per_block 3"):
        check_groups([bad], 256, "sm90", geo.buffer_sizes)


@pytest.mark.parametrize(
    "arch,bytes_per_state,ok",
    [
        ("sm90", 584, True),
        ("sm100", 528, True),
        ("sm90", 528, False),
        ("sm100", 584, False),
        ("sm89", 584, True),
    ],
)
def test_fp8_ds_mla_record_size_depends_on_arch(arch: str, bytes_per_state: int, ok: bool) -> None:
    geo = dsv41_flash(arch="sm100" if bytes_per_state == 528 else "sm90")
    if ok:
        check_groups(geo.groups, 256, arch, geo.buffer_sizes)
    else:
        with pytest.raises(ArchError, match="fp8_ds_mla"):
            check_groups(geo.groups, 256, arch, geo.buffer_sizes)


def test_nvfp4_refused_unless_sm100() -> None:
    geo = simple_model()
    g = geo.groups[0]
    fp4 = GroupSpec(
        name="fp4",
        kind="full",
        tokens_per_block=g.tokens_per_block,
        states_per_block=g.states_per_block,
        record_format="nvfp4_ds_mla",
        bytes_per_state=g.bytes_per_state,
        num_blocks=g.num_blocks,
        layers=g.layers,
    )
    check_groups([fp4], 256, "sm100", geo.buffer_sizes)
    with pytest.raises(ArchError, match="only valid on sm100"):
        check_groups([fp4], 256, "sm90", geo.buffer_sizes)


def test_layer_past_buffer_end_refused() -> None:
    geo = simple_model(num_blocks=8)
    with pytest.raises(GeometryError, match="last block ends at byte"):
        check_groups(geo.groups, 256, "sm90", [geo.buffer_sizes[0] - 1])


def test_overlapping_pages_refused() -> None:
    bad = GroupSpec(
        name="g",
        kind="full",
        tokens_per_block=16,
        states_per_block=16,
        record_format="bf16",
        bytes_per_state=64,
        num_blocks=4,
        layers=[LayerSpec(buffer=0, offset=0, block_stride=512, page_bytes=1024)],
    )
    with pytest.raises(GeometryError, match="overlap"):
        check_groups([bad], 256, "sm90", [1 << 20])


def test_page_smaller_than_records_refused() -> None:
    bad = GroupSpec(
        name="g",
        kind="full",
        tokens_per_block=16,
        states_per_block=16,
        record_format="bf16",
        bytes_per_state=64,
        num_blocks=4,
        layers=[LayerSpec(buffer=0, offset=0, block_stride=2048, page_bytes=1000)],
    )
    with pytest.raises(GeometryError, match="smaller than states_per_block"):
        check_groups([bad], 256, "sm90", [1 << 20])


def test_separate_layout_dsv41() -> None:
    geo = dsv41_flash()
    layout = build_layout(geo.groups, 256, separate=True)
    names = [og.name for og in layout.object_groups]
    assert names == ["full", "window128"]
    full, win = layout.object_groups
    assert [s.group_name for s in full.sections] == ["compressed", "indexer"]
    assert [s.group_name for s in win.sections] == ["swa0", "swa1"]
    # full: 4 blocks of 64 tokens; window: the trailing 4 of 8 blocks of 32 tokens
    assert all(s.n_blocks == 4 and s.first_block == 0 for s in full.sections)
    assert all(s.n_blocks == 4 and s.first_block == 4 for s in win.sections)
    assert full.object_bytes == 22 * 4 * 19008 + 22 * 4 * 4224
    assert win.object_bytes == 44 * 4 * 19008
    assert layout.chunk_bytes == geo.chunk_bytes(256) == 5_389_824
    # one buffer holding many layers coalesces into one run per group
    assert all(len(s.runs) == 1 for og in layout.object_groups for s in og.sections)
    assert layout.windows == {128: 1}


def test_combined_layout_one_object_group() -> None:
    geo = dsv41_flash()
    layout = build_layout(geo.groups, 256, separate=False)
    assert [og.name for og in layout.object_groups] == ["all"]
    assert layout.chunk_bytes == 5_389_824
    assert "compressor_scratch" not in [s.group_name for s in layout.object_groups[0].sections]


def test_sm100_records_give_a_different_fingerprint() -> None:
    a = build_layout(dsv41_flash("sm90").groups, 256, True)
    b = build_layout(dsv41_flash("sm100").groups, 256, True)
    assert a.object_groups[0].fingerprint != b.object_groups[0].fingerprint
    assert b.object_groups[1].object_bytes == 44 * 4 * 16896


def test_fingerprint_ignores_buffer_placement() -> None:
    a = dsv41_flash(num_blocks=32)
    b = dsv41_flash(num_blocks=64, stride_pad=128)
    fa = [og.fingerprint for og in build_layout(a.groups, 256, True).object_groups]
    fb = [og.fingerprint for og in build_layout(b.groups, 256, True).object_groups]
    assert fa == fb


def test_window_larger_than_chunk_stores_whole_chunks() -> None:
    geo = dsv41_flash(window_tokens=512)
    layout = build_layout(geo.groups, 256, True)
    win = layout.object_groups[1]
    assert all(s.n_blocks == 8 and s.first_block == 0 for s in win.sections)
    assert layout.windows == {512: 2}


def test_blocks_per_chunk_is_one_rule_for_server_client_and_planner() -> None:
    groups = dsv41_flash().groups
    planner = ChunkGeometry(
        256, 16, [EngineGroup(g.name, g.tokens_per_block, g.cached) for g in groups]
    )
    for g, eg in zip(groups, planner.groups, strict=True):
        want = 256 // g.tokens_per_block if g.cached else 0
        assert blocks_per_chunk(g, 256) == planner.blocks_per_chunk(eg) == want, g.name
    assert [blocks_per_chunk(g, 512) for g in groups] == [16, 16, 8, 8, 0]
