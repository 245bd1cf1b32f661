"""Registrations whose pages alias are refused, naming both layers.

Pages of two layers may share bytes only where vLLM shares them: different groups laid
over one tensor, for the same block id (one block-id space, a block owned by one group at a
time). Anything else (two layers of one group, a layer half a page into another, another
group's pages at a different block id, the scratch ring under a cached page of another
block) would let a store or retrieve alias KV silently.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest

from lmc_server.cache.geometry import (
    MAX_BLOCKS_PER_GROUP,
    MAX_UNEQUAL_STRIDE_PAIRS,
    GeometryError,
    GroupSpec,
    LayerSpec,
    check_groups,
    check_page_overlaps,
)
from lmc_server.cache.overlap import Pages, candidate_pairs
from lmc_server.client import Client, ServerError
from lmc_server.testing import ShmKV, dsv41_flash
from lmc_server.testing.presets import KVGeometry
from lmc_server.testing.process import ServerProcess

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _with_layers(geo: KVGeometry, group: str, layers: list[LayerSpec]) -> KVGeometry:
    groups = [
        msgspec.structs.replace(g, layers=layers) if g.name == group else g for g in geo.groups
    ]
    return replace(geo, groups=groups)


def _swa(geo: KVGeometry) -> GroupSpec:
    return next(g for g in geo.groups if g.name == "swa0")


def every_layer_at_offset_zero(geo: KVGeometry) -> KVGeometry:
    g = _swa(geo)
    return _with_layers(geo, g.name, [msgspec.structs.replace(la, offset=0) for la in g.layers])


def layer1_half_a_page_into_layer0(geo: KVGeometry) -> KVGeometry:
    g = _swa(geo)
    layers = list(g.layers)
    layers[1] = msgspec.structs.replace(layers[1], offset=layers[0].page_bytes // 2)
    return _with_layers(geo, g.name, layers)


def test_every_layer_of_a_group_at_offset_zero_is_refused() -> None:
    geo = every_layer_at_offset_zero(dsv41_flash())
    with pytest.raises(GeometryError) as e:
        check_groups(geo.groups, 256, "sm90", geo.buffer_sizes)
    assert "'swa0' layer 0 (swa0.0)" in str(e.value)
    assert "'swa0' layer 1 (swa0.1)" in str(e.value)


def test_layer_half_a_page_into_another_is_refused() -> None:
    geo = layer1_half_a_page_into_layer0(dsv41_flash())
    with pytest.raises(GeometryError) as e:
        check_groups(geo.groups, 256, "sm90", geo.buffer_sizes)
    msg = str(e.value)
    assert "'swa0' layer 0 (swa0.0)" in msg and "'swa0' layer 1 (swa0.1)" in msg
    assert "overlap in buffer 0" in msg


def _interleaved(
    num_blocks: int, n_layers: int, page: int, pad: int = 0, offset: int = 0
) -> list[LayerSpec]:
    """vLLM's layout when layers share a block: layer i at ``i * page`` in each block."""
    stride = n_layers * page + pad
    return [
        LayerSpec(
            buffer=0, offset=offset + i * page, block_stride=stride, page_bytes=page, name=f"l{i}"
        )
        for i in range(n_layers)
    ]


def _full(
    name: str, layers: list[LayerSpec], num_blocks: int, kind: str = "full", page: int = 1024
) -> GroupSpec:
    return GroupSpec(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        tokens_per_block=16,
        states_per_block=16,
        record_format="bf16",
        bytes_per_state=page // 16,
        num_blocks=num_blocks,
        layers=layers,
    )


def test_interleaved_layers_within_one_block_stride_are_accepted() -> None:
    layers = _interleaved(64, 8, 1024, pad=512)
    size = 64 * layers[0].block_stride
    check_groups([_full("g", layers, 64)], 256, "sm90", [size])


def test_interleaved_layer_one_byte_too_wide_is_refused() -> None:
    layers = _interleaved(64, 8, 1024)
    layers[3] = msgspec.structs.replace(layers[3], page_bytes=1025)
    size = 64 * layers[0].block_stride + 1
    with pytest.raises(GeometryError, match="'g' layer 3 \\(l3\\) and group 'g' layer 4 \\(l4\\)"):
        check_groups([_full("g", layers, 64, page=1024)], 256, "sm90", [size])


def test_groups_sharing_a_tensor_alias_only_for_the_same_block() -> None:
    """Two groups over one tensor (vLLM's hybrid allocator): the same offsets are fine;
    shifting one group by a whole block stride makes block b of one group share bytes with
    block b+1 of the other, which is refused."""
    a = _interleaved(64, 4, 1024)
    stride = a[0].block_stride
    size = 65 * stride
    check_groups([_full("a", a, 64), _full("b", a, 64)], 256, "sm90", [size])
    shifted = [msgspec.structs.replace(la, offset=la.offset + stride) for la in a]
    with pytest.raises(GeometryError, match="'a' layer 0 \\(l0\\) and group 'b' layer 0 \\(l0\\)"):
        check_groups([_full("a", a, 64), _full("b", shifted, 64)], 256, "sm90", [size])


def test_scratch_ring_over_another_blocks_pages_is_refused() -> None:
    a = _interleaved(64, 4, 1024)
    stride = a[0].block_stride
    ring_ok = [LayerSpec(buffer=0, offset=0, block_stride=stride, page_bytes=2048)]
    ring_bad = [LayerSpec(buffer=0, offset=3072, block_stride=stride, page_bytes=2048)]
    scratch = GroupSpec(
        name="ring",
        kind="scratch",
        tokens_per_block=8,
        states_per_block=8,
        record_format="bf16",
        bytes_per_state=512,
        num_blocks=64,
        layers=ring_ok,
    )
    check_groups([_full("a", a, 64), scratch], 256, "sm90", [64 * stride])
    bad = msgspec.structs.replace(scratch, layers=ring_bad)
    with pytest.raises(
        GeometryError, match="'a' layer 0 \\(l0\\) and group 'ring' layer 0.*block 1 of the first"
    ):
        check_groups([_full("a", a, 64), bad], 256, "sm90", [65 * stride])


def test_unequal_strides_in_one_buffer() -> None:
    """A group of 3 KiB pages every 3 KiB after one of 1 KiB pages every 2 KiB: disjoint
    regions pass; moving the second into the first's gaps still collides somewhere."""
    a = [LayerSpec(buffer=0, offset=1024, block_stride=2048, page_bytes=1024)]
    b_far = [LayerSpec(buffer=0, offset=2048 * 100, block_stride=3072, page_bytes=3072)]
    b_near = [LayerSpec(buffer=0, offset=0, block_stride=3072, page_bytes=1024)]
    size = 2048 * 100 + 3072 * 100
    check_groups([_full("a", a, 100), _full("b", b_far, 100, page=3072)], 256, "sm90", [size])
    with pytest.raises(GeometryError, match="'b' layer 0 and group 'a' layer 0"):
        check_groups([_full("a", a, 100), _full("b", b_near, 100)], 256, "sm90", [size])


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("vllm-*.json")))
def test_vllm_layouts_still_pass(fixture: str) -> None:
    data = json.loads((FIXTURES / fixture).read_text())
    reg = data["registration"]
    groups = msgspec.convert(reg["groups"], list[GroupSpec])
    size = data["vllm"]["backing_size_bytes"]
    check_groups(groups, 256, data["arch"] or "sm90", [size] * reg["buffers"])


def _pages(layers: list[LayerSpec], n: int) -> list[Pages]:
    return [Pages(la.offset, la.block_stride, la.page_bytes, n) for la in layers]


@pytest.mark.parametrize("layers", [100, 512])
def test_check_tests_no_pair_of_many_layers_of_any_number_of_blocks(layers: int) -> None:
    """Interleaved (every extent intersects every other: the worst case for a sweep by
    offset) and layer-major (every position within the stride the same: the worst case
    for a sweep by position), two groups over one tensor: the sweep picks the axis on
    which no two layers meet, so no pair is tested (the cost is a sort, not layers
    squared), and nothing is done per block (the most blocks a group may declare)."""
    n = MAX_BLOCKS_PER_GROUP
    inter = _interleaved(n, layers, 1024)
    stride = inter[0].block_stride
    major = [
        LayerSpec(buffer=0, offset=i * n * 1024, block_stride=1024, page_bytes=1024)
        for i in range(layers)
    ]
    for layout in (inter, major):
        assert list(candidate_pairs(_pages(layout, n))) == []
    check_groups([_full("a", inter, n), _full("b", inter, n)], 256, "sm90", [n * stride])
    check_groups([_full("a", major, n), _full("b", major, n)], 256, "sm90", [layers * n * 1024])


def test_too_many_unequal_stride_pairs_are_refused() -> None:
    """Layers of two strides interleaved in one region, none colliding: more pairs than
    the check will test on the event loop (``MAX_UNEQUAL_STRIDE_PAIRS``, which bounds
    its time) is refused; a quarter of the layers is checked and accepted."""
    big = 1 << 20
    a = [
        LayerSpec(buffer=0, offset=i * 1024, block_stride=big, page_bytes=1024) for i in range(200)
    ]
    b = [
        LayerSpec(buffer=0, offset=(512 + i) * 1024, block_stride=2 * big, page_bytes=1024)
        for i in range(200)
    ]
    assert len(list(candidate_pairs(_pages(a, 100) + _pages(b, 100)))) == 200 * 200
    assert 200 * 200 > MAX_UNEQUAL_STRIDE_PAIRS >= 50 * 50
    with pytest.raises(GeometryError, match="different block strides share a region"):
        check_groups([_full("a", a, 100), _full("b", b, 100)], 256, "sm90", [2 * big * 100])
    check_groups([_full("a", a[:50], 100), _full("b", b[:50], 100)], 256, "sm90", [2 * big * 100])


def test_server_refuses_aliased_registration_and_keeps_serving() -> None:
    with (
        ServerProcess(["--separate-object-groups"], l1_size_gb=0.25) as srv,
        Client(srv.endpoint) as c,
    ):
        for bad in (every_layer_at_offset_zero, layer1_half_a_page_into_layer0):
            geo = bad(dsv41_flash(num_blocks=16))
            with ShmKV(geo) as kv, pytest.raises(ServerError) as e:
                c.register(**kv.register_kwargs())
            assert e.value.code == "geometry" and "'swa0' layer 0" in e.value.message
        with ShmKV(dsv41_flash(num_blocks=16)) as kv:
            reg = c.register(**kv.register_kwargs())
            assert not reg.lookup_only
        assert c.stats().registrations == 1


def _brute_force_alias(groups: list[GroupSpec]) -> bool:
    """Enumerate every page: does any byte belong to two (group, layer) pages that are
    not of different groups at the same block id?"""
    owners: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for gi, g in enumerate(groups):
        for li, la in enumerate(g.layers):
            for b in range(g.num_blocks):
                start = la.offset + b * la.block_stride
                for byte in range(start, start + la.page_bytes):
                    seen = owners.setdefault((la.buffer, byte), [])
                    if any(o[0] == gi or o[2] != b for o in seen):
                        return True
                    seen.append((gi, li, b))
    return False


def test_overlap_check_agrees_with_enumerating_pages() -> None:
    """Random small layouts (equal and unequal strides, interleaved and layer-major, two
    buffers, scratch): the arithmetic refuses exactly what page enumeration finds."""
    rng = np.random.default_rng(17)
    refused = accepted = 0
    for _ in range(600):
        groups = []
        for gi in range(int(rng.integers(1, 4))):
            n = int(rng.integers(1, 6))
            layers = []
            stride = int(rng.choice([8, 12, 16, 24]))
            for _ in range(int(rng.integers(1, 4))):
                page = int(rng.integers(1, stride + 1)) if n > 1 else int(rng.integers(1, 9))
                layers.append(
                    LayerSpec(
                        buffer=int(rng.integers(0, 2)),
                        offset=int(rng.integers(0, 40)),
                        block_stride=stride,
                        page_bytes=page,
                    )
                )
            groups.append(
                GroupSpec(
                    name=f"g{gi}",
                    kind="scratch" if gi == 2 else "full",
                    tokens_per_block=16,
                    states_per_block=16,
                    record_format="raw",
                    bytes_per_state=1,
                    num_blocks=n,
                    layers=layers,
                )
            )
        want = _brute_force_alias(groups)
        try:
            check_page_overlaps(groups)
            got = False
        except GeometryError:
            got = True
        assert got == want, groups
        refused += got
        accepted += not got
    assert refused > 50 and accepted > 50, (refused, accepted)
