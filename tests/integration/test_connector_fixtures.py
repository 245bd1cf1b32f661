"""The connector's worker path over KV caches exactly as vLLM 0.33 allocates them (CPU).

The CPU twin of ``tests/gpu/test_connector_gpu.py``: the same fixtures
(``tests/fixtures/vllm-*.json``, made from vLLM's own classes by
``scripts/vllm-kv-fixture.py``) and the same flow
(:class:`lmc_server.testing.connector_flow.ConnectorFlow`), with the backing allocation
in shared memory and a server on the CPU engine, so every CI run checks the
fixture-driven path without vLLM, torch or a GPU.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmc_server.buffers import ShmBuffer
from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.integration.exporters import ExportedBuffer
from lmc_server.integration.kvlayout import GroupDesc, KVLayout, LayerDesc, derive_registration
from lmc_server.testing.connector_flow import ConnectorFlow
from lmc_server.testing.kvfixture import HostTensor, KVFixture, ShmBacking
from lmc_server.testing.process import ServerProcess

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NAMES = ["vllm-dsv41-sm90", "vllm-dsv41-sm100", "vllm-dsv41-sm100-b128", "vllm-llama"]
SEED = 7


def fixture(name: str) -> KVFixture:
    return KVFixture.load(FIXTURES / f"{name}.json")


def prompt(salt: int) -> list[int]:
    """Two whole 256-token chunks and a tail: a hit is 512 tokens, never the last one."""
    return [salt * 100_000 + i for i in range(2 * 256 + 60)]


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(
        ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"],
        l1_size_gb=0.5,
    ) as s:
        yield s


def cpu_arch(fx: KVFixture) -> str:
    """The CPU engine does not interpret records: register as the fixture's arch."""
    return fx.arch or "cpu"


@pytest.mark.parametrize("name", NAMES)
def test_fixture_rebuilds_vllm_allocation(name: str) -> None:
    """Views rebuilt from the fixture derive exactly the registration derived from
    vLLM's own tensors: same groups, offsets, strides, pages; one buffer for all."""
    fx = fixture(name)
    assert KVLayout.from_dict(fx.layout.to_dict()) == fx.layout
    with ShmBacking(fx.backing_size_bytes) as mem:
        plan = derive_registration(fx.layout, mem.views(fx))
        assert len(plan.buffers) == 1 == fx.raw["registration"]["buffers"]
        assert plan.groups == fx.groups
        assert (plan.kv_dtype, plan.replicated) == (fx.kv_dtype, fx.replicated)
        assert plan.engine_groups == [
            EngineGroup(**{**g, "server_groups": tuple(g["server_groups"])})
            for g in fx.raw["registration"]["engine_groups"]
        ]
        lookup = derive_registration(fx.layout)
        assert [(g.name, [layer.page_bytes for layer in g.layers]) for g in lookup.groups] == [
            (g.name, [layer.page_bytes for layer in g.layers]) for g in plan.groups
        ]


def test_dsv41_fixture_has_every_kind_of_group() -> None:
    """What the GPU test relies on: sliding windows, a compressed group whose indexer
    layers register as a second server group, scratch rings; MLA, so replicated."""
    fx = fixture("vllm-dsv41-sm90")
    kinds = [g.kind for g in fx.layout.groups]
    assert kinds.count("sliding_window") >= 1 and "full" in kinds and "scratch" in kinds
    formats = {(g.record_format, g.bytes_per_state) for g in fx.groups if g.cached}
    assert ("fp8_ds_mla", 584) in formats and ("uint8", 132) in formats
    assert fx.replicated and fx.scratch_groups
    sm100 = fixture("vllm-dsv41-sm100")
    assert {g.bytes_per_state for g in sm100.groups if g.record_format == "fp8_ds_mla"} == {528}


def test_sm100_128_token_compressed_blocks_register_and_follow_the_chunk_rule() -> None:
    """On SM100 vLLM prefers 128-token blocks for the compressed group (64
    states of two tokens). Registration takes them with 256-token chunks; a chunk
    size that is not a multiple of 128 is refused naming the group and the numbers."""
    from lmc_server.client import Client
    from lmc_server.client.core import ServerError

    fx = fixture("vllm-dsv41-sm100-b128")
    comp = [g for g in fx.groups if g.cached and g.kind == "full"]
    assert {(g.tokens_per_block, g.states_per_block) for g in comp} == {(128, 64)}
    ChunkGeometry(256, 32, derive_registration(fx.layout).engine_groups)
    with pytest.raises(ValueError, match="128 tokens per block"):
        ChunkGeometry(192, 32, derive_registration(fx.layout).engine_groups)
    with ServerProcess(["--chunk-size", "192"], l1_size_gb=0.1) as s, Client(s.endpoint) as c:
        with pytest.raises(ServerError) as err:
            c.register(
                model=fx.model,
                kv_dtype=fx.kv_dtype,
                arch="sm100",
                groups=derive_registration(fx.layout).groups,
                replicated=True,
            )
        assert err.value.code == "geometry"
        assert "g2.0" in err.value.message and "128" in err.value.message
        assert c.ping().server_version


@pytest.mark.parametrize("name", NAMES)
def test_store_then_load_byte_exact(srv: ServerProcess, name: str) -> None:
    """Stores leave the engine's memory alone; a hit loaded into other blocks writes
    exactly the stored pages of every cached group and layer, and nothing else (the
    scratch rings, which share the allocation, keep their bytes)."""
    fx = fixture(name)
    with (
        ShmBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(fx, mem, srv.endpoint, cpu_arch(fx)) as flow,
    ):
        # one prompt per fixture: sm100 and sm100-b128 share a namespace and, rightly,
        # their sliding-window objects, but this test's bytes are random, not a
        # function of the tokens
        flow.check_store_then_load(SEED, prompt(1 + 10 * NAMES.index(name)))


@pytest.mark.parametrize("name", NAMES)
def test_failed_load_is_reported_not_success(srv: ServerProcess, name: str) -> None:
    """Chunks never stored: the load finishes as failed (block ids for one engine group,
    the request for several, as vLLM 0.33 requires), and no byte changes."""
    fx = fixture(name)
    with (
        ShmBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(fx, mem, srv.endpoint, cpu_arch(fx)) as flow,
    ):
        flow.check_failed_load(SEED + 1, prompt(2 + 10 * NAMES.index(name)))


# -- the derivation's refusals ------------------------------------------------------------


class OneBuffer:
    """Exports every tensor as part of one host array (its first byte is the base)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def export(self, tensor: object) -> ExportedBuffer:
        return ExportedBuffer(
            ShmBuffer(name="lmc-test", size_bytes=self.array.size),
            int(self.array.ctypes.data),
            self.array.size,
        )


def one_layer(**overrides: object) -> KVLayout:
    layer: dict[str, Any] = dict(
        name="l0",
        record_format="bf16",
        states_per_block=4,
        bytes_per_state=16,
        page_bytes=64,
        block_stride=64,
        offset=0,
    )
    layer.update(overrides)
    return KVLayout(num_blocks=8, groups=(GroupDesc("full", 4, (LayerDesc(**layer),)),))


def test_derivation_checks_placement_against_the_plan() -> None:
    mem = np.zeros(8 * 64 * 2, dtype=np.uint8)
    blocks = HostTensor(mem[64 * 8 :].reshape(8, 64))  # the second half, 512 bytes in
    plan = derive_registration(one_layer(offset=512), {"l0": blocks}, OneBuffer(mem))
    assert plan.groups[0].layers[0].offset == 512
    with pytest.raises(ValueError, match="planned block 0 at byte 0"):
        derive_registration(one_layer(), {"l0": blocks}, OneBuffer(mem))
    with pytest.raises(KeyError, match="l0"):
        derive_registration(one_layer(), {}, OneBuffer(mem))


def test_derivation_refuses_pages_that_are_not_contiguous() -> None:
    """A head-outer layout ([H, B, N, C]): one block's bytes are spread over the heads."""
    mem = np.zeros(8 * 64, dtype=np.uint8)
    heads_outer = HostTensor(mem.reshape(2, 8, 2, 16).transpose(1, 0, 2, 3))
    with pytest.raises(ValueError, match="not contiguous"):
        derive_registration(one_layer(block_stride=32), {"l0": heads_outer}, OneBuffer(mem))


def test_one_block_table_drives_every_record_of_its_group() -> None:
    fx = fixture("vllm-dsv41-sm90")
    plan = derive_registration(fx.layout)
    (mixed,) = [g for g in plan.engine_groups if g.server_groups]
    geometry = ChunkGeometry(256, 32, plan.engine_groups)
    tables = [list(range(100 * i + 1, 100 * i + 20)) for i in range(len(plan.engine_groups))]
    ids = geometry.block_ids(tables, 0, 2)
    first, *rest = mixed.server_groups
    assert rest and all(ids[name].tolist() == ids[first].tolist() for name in rest)
    assert {g.name for g in plan.groups if g.cached} == set(ids)


def test_the_derivation_imports_neither_vllm_nor_torch() -> None:
    """What the GPU machine (no vLLM) and CI (no torch) rely on; a fresh interpreter,
    since this one may have imported either for other tests."""
    code = (
        "import sys, lmc_server.integration.kvlayout, lmc_server.testing.connector_flow, "
        "lmc_server.integration.vllm; "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
