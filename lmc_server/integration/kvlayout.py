"""An engine's KV cache in plain terms, and the server registration derived from it.

An engine adapter (:mod:`lmc_server.integration.vllm.geometry` for vLLM) maps the
engine's own KV cache classes onto :class:`KVLayout`: groups (one block table each) of
layers (one record and one page per block each). Everything the server is told is
derived here, from those descriptors plus the engine's tensors, so the derivation runs
and is tested where no engine is installed (CI, the GPU machine), and the adapter stays
a thin translation. This module imports neither vLLM nor torch; tensors are typed
``Any`` and only ``data_ptr()``, ``shape``, ``stride()`` and ``element_size()`` of
them are used (torch tensors have them; so does
:class:`lmc_server.testing.kvfixture.HostTensor`).

Why an engine group may become several server groups: a server
:class:`~lmc_server.cache.geometry.GroupSpec` has one record format and one size per
stored state, but an engine may keep layers with different records under one block
table (vLLM 0.33 groups DeepSeek-V4.1's compressed-KV layers, 584-byte records, with
its indexer layers, 132-byte records). Such an engine group is registered as one
server group per distinct record (``g<i>.0``, ``g<i>.1``, ... in first-seen order;
``g<i>`` when there is one), and its :class:`EngineGroup` names them all, so each
receives the engine group's block ids.

Invariants of :func:`derive_registration`:

* every backing allocation is registered once, however many layers of however many
  groups view it (engines overlay groups in one allocation); buffers are listed in the
  order their first layer appears;
* a layer's offset is where its block 0 lies in its backing allocation, read from the
  tensor; when the descriptor also states it (:attr:`LayerDesc.offset`), both agree or
  the derivation refuses;
* a layer's block stride is the engine's (:attr:`LayerDesc.block_stride`); without
  one, the tensor's dimension-0 stride;
* one block of a layer is one contiguous run of at most ``page_bytes`` (the server
  copies pages as runs); a tensor whose block spans more bytes is refused, since its
  pages are interleaved with other blocks' bytes;
* scratch groups are declared (so the registration mirrors the engine) but never
  cached and never sent block ids: one server group each, whatever its records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lmc_server.buffers import BufferSpec
from lmc_server.cache.geometry import GroupSpec, LayerSpec
from lmc_server.integration.chunks import EngineGroup
from lmc_server.integration.exporters import TensorExporter, exporter_for

GroupKind = Literal["full", "sliding_window", "scratch"]


@dataclass(frozen=True, slots=True)
class LayerDesc:
    """One layer of an engine group: its record and where the engine planned its pages.

    ``states_per_block`` stored states of ``bytes_per_state`` bytes make one block's
    record data; ``page_bytes`` is the page the engine keeps per block (padding
    included). ``mla`` says every rank holds identical KV for this layer.
    ``block_stride`` (bytes between consecutive blocks) and ``offset`` (block 0 in the
    backing allocation) are the engine's allocation plan; ``None`` when it has none.
    """

    name: str
    record_format: str
    states_per_block: int
    bytes_per_state: int
    page_bytes: int
    mla: bool = False
    block_stride: int | None = None
    offset: int | None = None

    @property
    def record(self) -> tuple[str, int, int]:
        """What one server group must have in common."""
        return (self.record_format, self.states_per_block, self.bytes_per_state)


@dataclass(frozen=True, slots=True)
class GroupDesc:
    """One engine KV cache group: one block table, one block size, its layers."""

    kind: GroupKind
    tokens_per_block: int
    layers: tuple[LayerDesc, ...]
    window_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Every group of an engine's KV cache; block ids run ``0 .. num_blocks - 1``."""

    num_blocks: int
    groups: tuple[GroupDesc, ...]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (what fixtures store)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVLayout:
        groups = tuple(
            GroupDesc(
                kind=g["kind"],
                tokens_per_block=int(g["tokens_per_block"]),
                window_tokens=int(g.get("window_tokens", 0)),
                layers=tuple(LayerDesc(**layer) for layer in g["layers"]),
            )
            for g in d["groups"]
        )
        return cls(num_blocks=int(d["num_blocks"]), groups=groups)


@dataclass(frozen=True)
class RegistrationPlan:
    """What a worker (with buffers) or a scheduler (lookup only) registers, plus the
    engine groups the planner slices block tables by."""

    groups: list[GroupSpec]
    engine_groups: list[EngineGroup]
    buffers: list[BufferSpec] = field(default_factory=list)
    replicated: bool = False
    kv_dtype: str = "bytes"


def block_extent_bytes(tensor: Any) -> int:
    """Bytes one block of ``tensor`` spans (dimension 0 indexes blocks); 0 for a tensor
    of one dimension, which says nothing about its blocks."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if len(shape) < 2 or any(n == 0 for n in shape):
        return 0
    last = sum((n - 1) * s for n, s in zip(shape[1:], strides[1:], strict=True))
    return (last + 1) * int(tensor.element_size())


class _Buffers:
    """Backing allocations in first-seen order, each exported once."""

    def __init__(self, exporter: TensorExporter | None) -> None:
        self.exporter = exporter
        self.specs: list[BufferSpec] = []
        self._index: dict[int, int] = {}

    def locate(self, tensor: Any) -> tuple[int, int]:
        """``(buffer index, byte offset of the tensor's first element in it)``."""
        exported = (self.exporter or exporter_for(tensor)).export(tensor)
        if exported.base_ptr not in self._index:
            self._index[exported.base_ptr] = len(self.specs)
            self.specs.append(exported.spec)
        return self._index[exported.base_ptr], int(tensor.data_ptr()) - exported.base_ptr


def _place(layer: LayerDesc, tensor: Any, buffers: _Buffers) -> LayerSpec:
    index, offset = buffers.locate(tensor)
    if layer.offset is not None and layer.offset != offset:
        raise ValueError(
            f"layer {layer.name!r}: the engine planned block 0 at byte "
            f"{layer.offset} of its allocation, the tensor starts at {offset}"
        )
    stride = layer.block_stride
    if stride is None:
        stride = int(tensor.stride()[0]) * int(tensor.element_size())
    extent = block_extent_bytes(tensor)
    if extent > layer.page_bytes:
        raise ValueError(
            f"layer {layer.name!r}: one block spans {extent} bytes of its "
            f"tensor, more than its {layer.page_bytes}-byte page; pages are "
            "not contiguous in this layout and cannot be copied as runs"
        )
    return LayerSpec(
        buffer=index,
        offset=offset,
        block_stride=stride,
        page_bytes=layer.page_bytes,
        name=layer.name,
    )


def _records(group: GroupDesc) -> list[list[LayerDesc]]:
    """The group's layers split by record, in first-seen order."""
    parts: dict[tuple[str, int, int], list[LayerDesc]] = {}
    for layer in group.layers:
        parts.setdefault(layer.record, []).append(layer)
    return list(parts.values())


def _layer_specs(
    group_name: str,
    layers: list[LayerDesc],
    cached: bool,
    tensors: Mapping[str, Any] | None,
    buffers: _Buffers,
) -> list[LayerSpec]:
    if tensors is None:
        return [
            LayerSpec(
                buffer=0,
                offset=0,
                block_stride=layer.page_bytes,
                page_bytes=layer.page_bytes,
                name=layer.name,
            )
            for layer in layers
        ]
    specs = []
    for layer in layers:
        if layer.name in tensors:
            specs.append(_place(layer, tensors[layer.name], buffers))
        elif cached:
            raise KeyError(f"no tensor for layer {layer.name!r} of group {group_name}")
    return specs


def derive_registration(
    layout: KVLayout,
    tensors: Mapping[str, Any] | None = None,
    exporter: TensorExporter | None = None,
) -> RegistrationPlan:
    """Server groups (and, with ``tensors``, buffers and page placement) for ``layout``.

    Without ``tensors`` (a scheduler's lookup-only registration) each layer is declared
    with its page size only: page sizes decide object layouts, placement does not.
    ``exporter`` overrides :func:`~lmc_server.integration.exporters.exporter_for`.
    """
    buffers = _Buffers(exporter)
    groups: list[GroupSpec] = []
    engine: list[EngineGroup] = []
    cached_layers: list[LayerDesc] = []
    for gi, group in enumerate(layout.groups):
        name = f"g{gi}"
        if not group.layers:
            raise ValueError(f"engine group {name} has no layers")
        cached = group.kind != "scratch"
        window = group.window_tokens if group.kind == "sliding_window" else 0
        parts = _records(group) if cached else [list(group.layers)]
        names = [name] if len(parts) == 1 else [f"{name}.{k}" for k in range(len(parts))]
        for part_name, layers in zip(names, parts, strict=True):
            first = layers[0]
            if cached:
                states, bps = first.states_per_block, first.bytes_per_state
                cached_layers.extend(layers)
            else:  # declared only: one nominal state of the largest page
                states, bps = 1, max(layer.page_bytes for layer in layers)
            groups.append(
                GroupSpec(
                    name=part_name,
                    kind=group.kind,
                    tokens_per_block=group.tokens_per_block,
                    states_per_block=states,
                    record_format=first.record_format,
                    bytes_per_state=bps,
                    num_blocks=layout.num_blocks,
                    window_tokens=window,
                    layers=_layer_specs(name, layers, cached, tensors, buffers),
                )
            )
        engine.append(
            EngineGroup(
                name=name,
                tokens_per_block=group.tokens_per_block,
                cached=cached,
                window_tokens=window,
                server_groups=tuple(names) if len(names) > 1 else (),
            )
        )
    kv_dtype = cached_layers[0].record_format if cached_layers else "bytes"
    replicated = bool(cached_layers) and all(layer.mla for layer in cached_layers)
    return RegistrationPlan(
        groups=groups,
        engine_groups=engine,
        buffers=buffers.specs,
        replicated=replicated,
        kv_dtype=kv_dtype,
    )
