#!/usr/bin/env python3
"""Write the vLLM KV cache fixtures the connector tests run on, from vLLM's real classes.

Run in the optional vLLM environment (docs/vllm.md), from the repository root:

    /work/vllm-venv/bin/python scripts/vllm-kv-fixture.py [--out tests/fixtures]

For each model below the script builds the per-layer KV cache specs (with vLLM's layer
classes where they can be built without weights, with vLLM's spec classes and the
layer's own arguments where not), lets vLLM 0.33 resolve the KV cache layout, group
the layers (``get_kv_cache_groups``), plan the allocation
(``get_kv_cache_config_from_groups``) and allocate it (``allocate_kv_cache``, the
function GPU workers call, here on the CPU). Each fixture then records:

* ``vllm``: the groups and ``KVCacheTensor`` placements vLLM planned, and every layer
  tensor it allocated (shape, strides, dtype, byte offset in the backing allocation);
* ``layout``: the plain descriptors the connector's adapter derives
  (``lmc_server.integration.vllm.geometry.describe``);
* ``registration``: the server groups the vLLM-free derivation produces from those
  descriptors and vLLM's tensors (``lmc_server.integration.kvlayout``).

Tests rebuild tensors with exactly these shapes, strides and sharing in shared memory
(CI) or GPU memory (the GPU machine), derive the registration again, check it equals
``registration`` and move real bytes through a server. Fixtures keep ``num_blocks`` and
the layer count small; the real counts are recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import msgspec  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
)
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from lmc_server.buffers import ShmBuffer  # noqa: E402
from lmc_server.integration.exporters import ExportedBuffer  # noqa: E402
from lmc_server.integration.kvlayout import derive_registration  # noqa: E402
from lmc_server.integration.vllm.geometry import describe  # noqa: E402

DSV41_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
DSV41_BLOCK = 64  # tokens per block of the compressed and indexer caches
DSV41_WINDOW = 128
DSV41_HEAD_DIM = 512
DSV41_INDEX_HEAD_DIM = 128
DSV41_RATIO = 2  # kv-source layers: two tokens per stored state (DSV41.md)
DSV41_PRESET_LAYERS = 44  # lmc_server.testing.presets.dsv41_flash's illustrative default
# The main record: 584 B on SM90 and every non-SM100 arch (576-byte page rows), 528 B
# on SM100 (512-byte rows), as vLLM's DeepseekV4Attention picks them.
RECORDS = {"sm90": (584, 576), "sm100": (528, 512)}


class StorageExporter:
    """Locates CPU tensors in their torch storage (vLLM's one backing allocation)."""

    def export(self, tensor: Any) -> ExportedBuffer:
        storage = tensor.untyped_storage()
        size = int(storage.nbytes())
        return ExportedBuffer(
            ShmBuffer(name="vllm-backing", size_bytes=size), int(storage.data_ptr()), size
        )


def vllm_config(block_size: int, cache_dtype: str, num_blocks: int) -> VllmConfig:
    cache = CacheConfig(
        block_size=block_size, cache_dtype=cache_dtype, num_gpu_blocks_override=num_blocks
    )
    return VllmConfig(device_config=DeviceConfig(device="cpu"), cache_config=cache)


def dsv41_layers(
    vc: VllmConfig, arch: str, n_layers: int
) -> tuple[dict[str, KVCacheSpec], list[type]]:
    """Per-layer specs of DeepSeek-V4.1-Flash and the attention backends that use them.

    Every layer has a sliding-window MLA cache; every second layer is a kv-source layer
    with a compressed MLA cache, an indexer key cache and a compressor state ring.
    """
    from vllm.models.deepseek_v41.attention import (
        DeepseekV4IndexerCache,
        _indexer_k_cache_head_dim,
    )
    from vllm.models.deepseek_v41.compressor import CompressorStateCache
    from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    record, align = RECORDS[arch]
    v41 = arch == "sm100"
    specs: dict[str, KVCacheSpec] = {}
    backends: list[type] = [DeepseekV4FlashMLABackend]
    with set_current_vllm_config(vc):
        for i in range(n_layers):
            prefix = f"model.layers.{i}.attn"
            # DeepseekV4Attention.__init__ builds the SWA cache with these arguments.
            swa = DeepseekV4SWACache(
                head_dim=DSV41_HEAD_DIM,
                window_size=DSV41_WINDOW,
                dtype=torch.uint8,
                prefix=f"{prefix}.swa_cache",
                cache_config=vc.cache_config,
                block_size=32,
                packed_bytes_per_token=record,
                packed_page_alignment=align,
                packed_block_stride_alignment=math.lcm(record, record) if v41 else None,
                bounded_replay=False,
            )
            specs[swa.prefix] = swa.get_kv_cache_spec(vc)
            backends.append(swa.get_attn_backend())
            if i % 2:
                continue
            # DeepseekV4Attention.get_kv_cache_spec (kv-source layers), fp8_ds_mla.
            specs[prefix] = MLAAttentionSpec(
                block_size=DSV41_BLOCK,
                num_kv_heads=1,
                head_size=DSV41_HEAD_DIM,
                dtype=torch.uint8,
                tokens_per_state=DSV41_RATIO,
                cache_dtype_str="fp8_ds_mla",
                alignment=align,
                model_version="deepseek_v4",
                kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
                state_content_bytes=record,
            )
            idx = DeepseekV4IndexerCache(
                head_dim=_indexer_k_cache_head_dim(DSV41_INDEX_HEAD_DIM, False),
                dtype=torch.uint8,
                prefix=f"{prefix}.indexer.k_cache",
                cache_config=vc.cache_config,
                compress_ratio=DSV41_RATIO,
            )
            idx_spec = idx.get_kv_cache_spec(vc)
            if v41:  # the CPU platform is not SM100; the layer then aligns pages to 512
                idx_spec = replace(idx_spec, alignment=512)
            specs[idx.prefix] = idx_spec
            backends.append(idx.get_attn_backend())
            ring = CompressorStateCache(
                state_dim=2 * DSV41_HEAD_DIM,
                dtype=torch.float32,
                prefix=f"{prefix}.compressor.state_cache",
            )
            specs[ring.prefix] = ring.get_kv_cache_spec(vc)
            backends.append(ring.get_attn_backend())
    return specs, backends


def plain_layers(n_layers: int) -> tuple[dict[str, KVCacheSpec], list[type]]:
    """A Llama-3-8B-like model: full attention, 8 KV heads of 128, bf16 K and V.

    Its FlashAttention backend declares no KV cache layout, so vLLM's default
    preference decides (no backend listed).
    """
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(n_layers)}, []


def group_summary(groups: list[Any]) -> list[dict[str, Any]]:
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        layer_specs = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        kinds: dict[str, int] = {}
        for s in layer_specs:
            kinds[type(s).__name__] = kinds.get(type(s).__name__, 0) + 1
        out.append(
            {
                "spec": type(spec).__name__,
                "block_size": int(spec.block_size),
                "layers": len(g.layer_names),
                "layer_specs": kinds,
                "prefix_cacheable": bool(spec.prefix_cacheable),
                "enable_kv_transfer": bool(g.enable_kv_transfer),
            }
        )
    return out


def tensor_entry(t: torch.Tensor) -> dict[str, Any]:
    es = t.element_size()
    base = t.untyped_storage().data_ptr()
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "element_size": es,
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "offset_bytes": t.data_ptr() - base,
    }


def resolve_layout(vc: VllmConfig, specs: dict[str, KVCacheSpec], backends: list[type]) -> Any:
    """The layout the engine core would record on ``vc`` for these backends."""
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    return resolve_kv_cache_layout(vc, [layouts], specs.values())


def build(
    name: str,
    specs: dict[str, KVCacheSpec],
    backends: list[type],
    vc: VllmConfig,
    notes: dict[str, Any],
) -> dict[str, Any]:
    layout = resolve_layout(vc, specs, backends)
    groups = get_kv_cache_groups(vc, dict(specs))
    cfg = get_kv_cache_config_from_groups(vc, groups, available_memory=1 << 40)
    caches = allocate_kv_cache(cfg, torch.device("cpu"), layout)
    storages = {t.untyped_storage().data_ptr() for t in caches.values()}
    assert len(storages) == 1, "vLLM 0.33 backs every layer with one allocation"
    kv_layout = describe(cfg)
    plan = derive_registration(kv_layout, caches, StorageExporter())
    return {
        "fixture": name,
        "generated_by": "scripts/vllm-kv-fixture.py",
        "vllm_version": vllm.__version__,
        **notes,
        "kv_cache_layout": layout.name,
        "num_blocks": cfg.num_blocks,
        "vllm": {
            "groups": [
                {**s, "layer_names": list(g.layer_names)}
                for s, g in zip(
                    group_summary(cfg.kv_cache_groups), cfg.kv_cache_groups, strict=True
                )
            ],
            "kv_cache_tensors": [
                {
                    "layers": list(t.layers),
                    "size": t.size,
                    "offset": t.offset,
                    "layer_stride": t.layer_stride,
                    "block_stride": t.block_stride,
                }
                for t in cfg.kv_cache_tensors
            ],
            "backing_size_bytes": next(iter(caches.values())).untyped_storage().nbytes(),
            "tensors": {n: tensor_entry(t) for n, t in caches.items()},
        },
        "layout": kv_layout.to_dict(),
        "registration": {
            "kv_dtype": plan.kv_dtype,
            "replicated": plan.replicated,
            "buffers": len(plan.buffers),
            "groups": msgspec.to_builtins(plan.groups),
            "engine_groups": [asdict(g) for g in plan.engine_groups],
        },
    }


def dsv41_sm100_b128(num_blocks: int, n_layers: int) -> dict[str, Any]:
    """DeepSeek-V4.1 on SM100 with 128-token blocks for the compressed and indexer
    caches, the block size vLLM's sparse-MLA backend prefers there (64 stored states
    per block at two tokens per state)."""
    global DSV41_BLOCK
    old, DSV41_BLOCK = DSV41_BLOCK, 128
    try:
        vc = vllm_config(DSV41_BLOCK, "fp8_ds_mla", num_blocks)
        specs, backends = dsv41_layers(vc, "sm100", n_layers)
        return build(
            "vllm-dsv41-sm100-b128",
            specs,
            backends,
            vc,
            {
                "model": DSV41_MODEL,
                "arch": "sm100",
                "kv_cache_dtype": "fp8_ds_mla",
                "layers": n_layers,
                "real_layers": "not published (see vllm-dsv41-sm100.json)",
                "assumptions": [
                    "as vllm-dsv41-sm100, but compressed and indexer caches use 128-token "
                    "blocks (64 states of two tokens), as vLLM's sparse-MLA backend prefers "
                    "on SM100",
                ],
            },
        )
    finally:
        DSV41_BLOCK = old


def generate(
    num_blocks: int = 128,
    dsv41_layers_n: int = 8,
    plain_layers_n: int = 4,
    plain_num_blocks: int = 96,
) -> dict[str, dict[str, Any]]:
    """Every fixture, by name (``tests/vllm/test_vllm_fixtures.py`` compares these with
    the files in ``tests/fixtures``; the defaults made them)."""
    fixtures = {}
    for arch in RECORDS:
        vc = vllm_config(DSV41_BLOCK, "fp8_ds_mla", num_blocks)
        specs, backends = dsv41_layers(vc, arch, dsv41_layers_n)
        full_vc = vllm_config(DSV41_BLOCK, "fp8_ds_mla", num_blocks)
        full_specs, full_backends = dsv41_layers(full_vc, arch, DSV41_PRESET_LAYERS)
        resolve_layout(full_vc, full_specs, full_backends)
        notes = {
            "model": DSV41_MODEL,
            "arch": arch,
            "kv_cache_dtype": "fp8_ds_mla",
            "layers": dsv41_layers_n,
            "real_layers": (
                "not published; the project's preset uses "
                f"{DSV41_PRESET_LAYERS} (illustrative), grouped by vLLM as in "
                "preset_groups"
            ),
            "preset_groups": group_summary(get_kv_cache_groups(full_vc, full_specs)),
            "assumptions": [
                "every second layer is a kv-source layer (compressed KV, indexer, "
                f"compressor ring) with compress ratio {DSV41_RATIO}",
                f"compressed and indexer caches use {DSV41_BLOCK}-token blocks",
                "SWA bounded replay off (vLLM turns it off without model runner V2)",
                "no speculative tokens (compressor ring of 8 rows)",
                "the indexer cache declares no cache role, so its record is 'uint8'",
            ],
        }
        fixtures[f"vllm-dsv41-{arch}"] = build(f"vllm-dsv41-{arch}", specs, backends, vc, notes)
    fixtures["vllm-dsv41-sm100-b128"] = dsv41_sm100_b128(num_blocks, dsv41_layers_n)
    vc = vllm_config(16, "auto", plain_num_blocks)
    specs, backends = plain_layers(plain_layers_n)
    fixtures["vllm-llama"] = build(
        "vllm-llama",
        specs,
        backends,
        vc,
        {
            "model": "test/llama-3-8b-like",
            "arch": None,
            "kv_cache_dtype": "auto (bf16)",
            "layers": plain_layers_n,
            "real_layers": 32,
            "assumptions": ["8 KV heads of 128 dims, bf16 K and V, 16-token blocks"],
        },
    )
    return fixtures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--dsv41-layers", type=int, default=8)
    ap.add_argument("--plain-layers", type=int, default=4)
    ap.add_argument("--plain-num-blocks", type=int, default=96)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fixtures = generate(
        args.num_blocks, args.dsv41_layers, args.plain_layers, args.plain_num_blocks
    )
    for name, data in fixtures.items():
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
