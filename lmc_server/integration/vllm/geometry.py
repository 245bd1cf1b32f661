"""vLLM's KV cache config as plain descriptors (:mod:`lmc_server.integration.kvlayout`).

This is the only place that reads vLLM's KV cache classes (and its block objects'
ids, :func:`block_ids`); what the server is told
is derived from the descriptors by the vLLM-free
:func:`~lmc_server.integration.kvlayout.derive_registration`.

Mapping, per vLLM KV cache group (a ``UniformTypeKVCacheSpecs`` group is read layer by
layer; vLLM puts only layers of one spec type in a group):

* ``CircularBufferSpec`` (DeepSeek-V4's compressor ring) or a group excluded from KV
  transfer: ``scratch`` (declared, never cached, never sent block ids);
* ``SlidingWindowSpec`` and ``SlidingWindowMLASpec``: ``sliding_window`` with the
  spec's window;
* every other attention spec (full, MLA, compressed MLA with ``tokens_per_state > 1``,
  the sparse indexer): ``full``.

Per layer: ``states_per_block`` is the spec's stored states per block,
``bytes_per_state`` the unpadded page divided by the states, ``page_bytes`` the
(possibly padded) page. The allocation plan comes from vLLM's ``KVCacheTensor``: layer
``l`` of a tensor has its block 0 at ``offset + l * layer_stride`` of the backing
allocation and blocks ``block_stride`` apart (padded, block-outermost and overlaid
layouts included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmc_server.integration.exporters import TensorExporter
from lmc_server.integration.kvlayout import (
    GroupDesc,
    GroupKind,
    KVLayout,
    LayerDesc,
    RegistrationPlan,
    derive_registration,
)


def block_ids(blocks: Sequence[Any]) -> list[int]:
    """The ids of vLLM ``KVCacheBlock`` objects (fixed for a block's life). A
    comprehension: its attribute reads beat ``map(attrgetter(...))``, and the step
    that takes 256 hits reads thousands."""
    return [b.block_id for b in blocks]


def _layer_spec(group: Any, layer_name: str) -> Any:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec


def _kind(group: Any, spec: Any) -> tuple[GroupKind, int]:
    from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowSpec

    if isinstance(spec, CircularBufferSpec) or not getattr(group, "enable_kv_transfer", True):
        return "scratch", 0
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window", int(spec.sliding_window)
    return "full", 0


def _record_format(spec: Any) -> str:
    role = getattr(spec, "cache_role", None)
    fmt = getattr(spec, "cache_dtype_str", None)
    if not fmt or fmt == "auto":
        fmt = str(getattr(spec, "dtype", "bytes")).removeprefix("torch.")
    if role is not None and str(getattr(role, "value", role)) == "indexer":
        return "indexer_fp8" if "fp8" in fmt else f"indexer_{fmt}"
    return str(fmt)


def _is_mla(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    return isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec)


def _layer(name: str, spec: Any, plan: dict[str, tuple[int, int]]) -> LayerDesc:
    states = int(spec.num_states)
    unpadded = int(getattr(spec, "unpadded_page_size_bytes", spec.page_size_bytes))
    stride, offset = plan.get(name, (None, None))
    return LayerDesc(
        name=name,
        record_format=_record_format(spec),
        states_per_block=states,
        bytes_per_state=max(1, unpadded // max(1, states)),
        page_bytes=int(spec.page_size_bytes),
        mla=_is_mla(spec),
        block_stride=stride,
        offset=offset,
    )


def describe(kv_cache_config: Any) -> KVLayout:
    """The plain description of vLLM's ``kv_cache_config``."""
    plan: dict[str, tuple[int, int]] = {}
    for t in kv_cache_config.kv_cache_tensors:
        for index, name in enumerate(t.layers):
            plan[name] = (int(t.block_stride), int(t.offset) + index * int(t.layer_stride))
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        specs = {name: _layer_spec(group, name) for name in group.layer_names}
        kind, window = _kind(group, next(iter(specs.values()), group.kv_cache_spec))
        layers = tuple(_layer(name, spec, plan) for name, spec in specs.items())
        groups.append(
            GroupDesc(
                kind=kind,
                tokens_per_block=int(group.kv_cache_spec.block_size),
                layers=layers,
                window_tokens=window,
            )
        )
    return KVLayout(num_blocks=int(kv_cache_config.num_blocks), groups=tuple(groups))


def build_groups(
    kv_cache_config: Any,
    kv_caches: dict[str, Any] | None = None,
    exporter: TensorExporter | None = None,
) -> RegistrationPlan:
    """Server groups for vLLM's ``kv_cache_config``; with ``kv_caches``, real placement."""
    return derive_registration(describe(kv_cache_config), kv_caches, exporter)
