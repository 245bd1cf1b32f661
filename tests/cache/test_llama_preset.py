"""The Llama-3-8B-like preset: vLLM's per-layer KV tensors in the FlashAttention and
FlashInfer shapes, as the server sees them (registration checks, coalesced runs, object
bytes), and a CPU-backend server storing and retrieving it byte-exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from lmc_server.bench.cli import bench
from lmc_server.bench.common import GeometryArgs
from lmc_server.cache.geometry import check_groups
from lmc_server.cache.layout import build_layout
from lmc_server.testing.presets import llama3_8b

PLANE = 16 * 8 * 128 * 2  # one block of K (or V) of one layer: 32 KiB


@pytest.mark.parametrize("placement", ["layer", "block"])
@pytest.mark.parametrize("backend", ["flash_attn", "flashinfer"])
def test_geometry_passes_registration_and_holds_32_mib_a_chunk(
    backend: str, placement: str
) -> None:
    geo = llama3_8b(num_blocks=64, backend=backend, placement=placement)
    check_groups(geo.groups, 256, "sm90", geo.buffer_sizes)
    assert len(geo.buffer_sizes) == (32 if placement == "layer" else 1)
    assert sum(geo.buffer_sizes) == 32 * 2 * 64 * PLANE
    (g,) = geo.groups
    assert (g.kind, g.tokens_per_block, g.record_format) == ("full", 16, "bf16")
    # 256 tokens: 16 blocks of 32 layers of K and V
    assert geo.chunk_bytes(256) == 16 * 32 * 2 * PLANE == 32 << 20
    layout = build_layout(geo.groups, 256, separate=True)
    (og,) = layout.object_groups
    assert og.object_bytes == 32 << 20
    runs = og.sections[0].runs
    if placement == "block":  # every layer of a block side by side: one run
        assert len(runs) == 1 and runs[0].layer_stride == runs[0].page_bytes
    elif backend == "flash_attn":  # a layer's K and V planes: a run of two pages
        assert len(runs) == 32
        assert {(r.n_layers, r.layer_stride, r.page_bytes) for r in runs} == {
            (2, 64 * PLANE, PLANE)
        }
    else:  # one 64 KiB page per block and layer
        assert len(runs) == 32 and {(r.n_layers, r.page_bytes) for r in runs} == {(1, 2 * PLANE)}


def test_flash_attn_pages_are_k_and_v_planes_of_each_layer_tensor() -> None:
    """``[2, num_blocks, 16, 8, 128]`` per layer: block b's K at b * 32 KiB, its V
    ``num_blocks`` planes further; FlashInfer's ``[num_blocks, 2, ...]`` keeps them
    side by side."""
    fa = llama3_8b(num_blocks=10, layers=3, backend="flash_attn")
    k, v = fa.groups[0].layers[2:4]
    assert (k.buffer, k.offset, k.block_stride, k.page_bytes) == (1, 0, PLANE, PLANE)
    assert (v.buffer, v.offset, v.block_stride, v.page_bytes) == (1, 10 * PLANE, PLANE, PLANE)
    fi = llama3_8b(num_blocks=10, layers=3, backend="flashinfer")
    (p,) = fi.groups[0].layers[1:2]
    assert (p.buffer, p.offset, p.block_stride, p.page_bytes) == (1, 0, 2 * PLANE, 2 * PLANE)
    with pytest.raises(ValueError, match="attention backend"):
        llama3_8b(backend="paged")


def test_bench_model_option_builds_the_llama_preset() -> None:
    geo = GeometryArgs(model="llama-flashinfer", placement="layer").build(48)
    assert geo.model == "meta-llama/Meta-Llama-3-8B" and len(geo.buffer_sizes) == 32
    assert "flashinfer" in GeometryArgs(model="llama-flashinfer").describe()
    assert GeometryArgs().build(8).model.startswith("deepseek-ai/")
    with pytest.raises(ValueError, match="model preset"):
        GeometryArgs(model="gpt").build(8)


@pytest.mark.parametrize(
    ("model", "placement"),
    [("llama-flash-attn", "layer"), ("llama-flashinfer", "layer"), ("llama-flash-attn", "block")],
)
def test_cpu_server_stores_and_retrieves_it_byte_exact(
    tmp_path: Path, model: str, placement: str
) -> None:
    """``bench throughput`` on the CPU backend: real server, real client, every
    retrieved byte compared with the stored pages."""
    out = tmp_path / "r.json"
    args = ["throughput", "--model", model, "--placement", placement, "--layers", "4"]
    args += ["--batches", "1,3", "--min-time-s", "0.05", "--min-iters", "2"]
    args += ["--l1-size-gb", "1", "--json", str(out), "--no-progress"]
    res = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["config"]["chunk_bytes"] == 16 * 4 * 2 * PLANE
    assert r["rows"] and all(x["mismatched_bytes"] == 0 for x in r["rows"])
    assert all(x["failed_chunks"] == 0 for x in r["rows"])
    assert np.isclose(
        min(x["bytes"] for x in r["rows"] if x["mode"] == "store"), 16 * 4 * 2 * PLANE
    )
