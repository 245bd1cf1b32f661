"""vLLM's KV cache config (and, on workers, its KV tensors) as server group specs.

Mapping, per vLLM KV cache group:

* ``CircularBufferSpec`` (DeepSeek-V4's compressor ring) or a group excluded from KV
  transfer: ``scratch`` (declared, never cached, never sent block ids);
* ``SlidingWindowSpec`` and ``SlidingWindowMLASpec``: ``sliding_window`` with the
  spec's window;
* every other attention spec (full, MLA, compressed MLA with ``tokens_per_state > 1``,
  the sparse indexer): ``full``.

``tokens_per_block`` is the spec's block size, ``states_per_block`` its stored states
per block, ``bytes_per_state`` the unpadded page divided by the states; each layer's
``page_bytes`` is the (possibly padded) page. On workers, each layer's offset is where
its block 0 starts inside the backing allocation and its block stride comes from
vLLM's ``KVCacheTensor`` (padded and block-outermost layouts included); allocations
shared by many layers are registered once. The scheduler registers the same groups
without buffers (lookup only): page sizes, and so object layouts, match the workers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmc_server.cache.geometry import BufferSpec, GroupSpec, LayerSpec
from lmc_server.integration.exporters import TensorExporter, exporter_for
from lmc_server.integration.planning import EngineGroup


@dataclass(frozen=True)
class VllmGroups:
    groups: list[GroupSpec]
    engine_groups: list[EngineGroup]
    buffers: list[BufferSpec]
    replicated: bool
    kv_dtype: str


def _kind(group: Any) -> tuple[str, int]:
    from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowSpec

    spec = group.kv_cache_spec
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


def _states_and_bytes(spec: Any) -> tuple[int, int]:
    states = int(spec.num_states)
    unpadded = int(getattr(spec, "unpadded_page_size_bytes", spec.page_size_bytes))
    return states, max(1, unpadded // max(1, states))


def build_groups(kv_cache_config: Any, kv_caches: dict[str, Any] | None = None,
                 exporter: TensorExporter | None = None) -> VllmGroups:
    """Group specs for vLLM's ``kv_cache_config``; with ``kv_caches``, real placement."""
    placement: dict[str, tuple[int, int, int]] = {}
    buffers: list[BufferSpec] = []
    if kv_caches is not None:
        base_index: dict[int, tuple[int, int]] = {}
        stride_of: dict[str, int] = {}
        for t in kv_cache_config.kv_cache_tensors:
            for name in t.layers:
                stride_of[name] = int(t.block_stride)
        for name, tensor in kv_caches.items():
            ex = exporter or exporter_for(tensor)
            exported = ex.export(tensor)
            if exported.base_ptr not in base_index:
                base_index[exported.base_ptr] = (len(buffers), exported.base_ptr)
                buffers.append(exported.spec)
            index, base = base_index[exported.base_ptr]
            stride = stride_of.get(name, int(tensor.stride(0)) * int(tensor.element_size()))
            placement[name] = (index, int(tensor.data_ptr()) - base, stride)
    groups: list[GroupSpec] = []
    engine: list[EngineGroup] = []
    mla = True
    dtypes: list[str] = []
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind, window = _kind(group)
        name = f"g{gi}"
        tokens = int(spec.block_size)
        page = int(spec.page_size_bytes)
        if kind == "scratch":
            states, bps = 1, page
        else:
            states, bps = _states_and_bytes(spec)
            mla = mla and _is_mla(spec)
            dtypes.append(_record_format(spec))
        layers = []
        for lname in group.layer_names:
            if lname in placement:
                buf, off, stride = placement[lname]
            else:
                buf, off, stride = 0, 0, page
            layers.append(LayerSpec(buffer=buf, offset=off, block_stride=stride,
                                    page_bytes=page, name=lname))
        fmt = _record_format(spec)
        groups.append(GroupSpec(name=name, kind=kind,  # type: ignore[arg-type]
                                tokens_per_block=tokens, states_per_block=states,
                                record_format=fmt, bytes_per_state=bps,
                                num_blocks=int(kv_cache_config.num_blocks), layers=layers,
                                window_tokens=window))
        engine.append(EngineGroup(name=name, tokens_per_block=tokens,
                                  cached=kind != "scratch", window_tokens=window))
    kv_dtype = dtypes[0] if dtypes else "bytes"
    return VllmGroups(groups=groups, engine_groups=engine, buffers=buffers,
                      replicated=mla and bool(dtypes), kv_dtype=kv_dtype)
