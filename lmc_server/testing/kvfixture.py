"""vLLM KV cache fixtures rebuilt as real memory, and what a load must write into it.

A fixture (``tests/fixtures/vllm-*.json``, written by ``scripts/vllm-kv-fixture.py``
from vLLM 0.33's own classes) records the KV cache vLLM allocated for a model: one
backing allocation and, per layer, a strided view of it (shape, strides, dtype, byte
offset); the plain descriptors the connector's adapter derived from vLLM's config; and
the server groups derived from both. Tests rebuild exactly those views over their own
backing allocation: :class:`ShmBacking` (shared memory, no torch: CI) or
:class:`lmc_server.testing.cuda_kv.CudaBacking` (GPU memory), both with the interface
:class:`Backing` names, so one flow (:mod:`lmc_server.testing.connector_flow`) runs on
either.

:func:`expected_copies` states, from the registered groups alone, which pages a
retrieve writes: every block of every chunk for full groups, the trailing
``ceil(W / tokens_per_block)`` blocks of the last ``ceil(W / chunk_size)`` chunks for
a sliding window of W tokens, nothing for ``-1`` ids or scratch groups.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self

import msgspec
import numpy as np

from lmc_server.cache.geometry import GroupSpec, blocks_per_chunk
from lmc_server.client.shm import ShmSegment
from lmc_server.integration.exporters import register_shm_segment, unregister_shm_segment
from lmc_server.integration.kvlayout import KVLayout
from lmc_server.testing.kv import fill_random_bytes


@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """One layer tensor as vLLM allocated it: a strided view of the backing allocation.

    ``shape`` and ``stride`` are in elements of ``dtype``; the view starts
    ``offset_bytes`` into the allocation. The last dimension is contiguous.
    """

    dtype: str
    element_size: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset_bytes: int

    @property
    def shape_bytes(self) -> tuple[int, ...]:
        """The same view over bytes (the last dimension counted in bytes)."""
        return (*self.shape[:-1], self.shape[-1] * self.element_size)

    @property
    def stride_bytes(self) -> tuple[int, ...]:
        if self.stride[-1] != 1:
            raise ValueError(f"last dimension not contiguous: strides {self.stride}")
        return (*(s * self.element_size for s in self.stride[:-1]), 1)


@dataclass(frozen=True)
class KVFixture:
    """A fixture file: vLLM's allocation, the adapter's descriptors, the derived groups."""

    name: str
    model: str
    arch: str | None
    backing_size_bytes: int
    tensors: dict[str, TensorPlacement]
    layout: KVLayout
    groups: list[GroupSpec]
    kv_dtype: str
    replicated: bool
    raw: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> KVFixture:
        d = json.loads(Path(path).read_text())
        tensors = {
            name: TensorPlacement(
                dtype=t["dtype"],
                element_size=int(t["element_size"]),
                shape=tuple(t["shape"]),
                stride=tuple(t["stride"]),
                offset_bytes=int(t["offset_bytes"]),
            )
            for name, t in d["vllm"]["tensors"].items()
        }
        reg = d["registration"]
        return cls(
            name=d["fixture"],
            model=d["model"],
            arch=d.get("arch"),
            backing_size_bytes=int(d["vllm"]["backing_size_bytes"]),
            tensors=tensors,
            layout=KVLayout.from_dict(d["layout"]),
            groups=msgspec.convert(reg["groups"], list[GroupSpec]),
            kv_dtype=reg["kv_dtype"],
            replicated=bool(reg["replicated"]),
            raw=d,
        )

    @property
    def scratch_groups(self) -> list[GroupSpec]:
        return [g for g in self.groups if not g.cached]


class HostTensor:
    """A strided numpy view with the part of torch's tensor interface the connector's
    derivation and the shared-memory exporter read (``data_ptr``, ``shape``,
    ``stride``, ``element_size``, ``is_cuda``)."""

    is_cuda = False

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape = tuple(array.shape)

    def data_ptr(self) -> int:
        return int(self.array.__array_interface__["data"][0])

    def element_size(self) -> int:
        return int(self.array.itemsize)

    def stride(self) -> tuple[int, ...]:
        return tuple(int(s) // self.array.itemsize for s in self.array.strides)


def host_views(fx: KVFixture, backing: np.ndarray) -> dict[str, HostTensor]:
    """The fixture's layer tensors over ``backing`` (uint8, the backing allocation)."""
    out = {}
    for name, t in fx.tensors.items():
        raw = np.lib.stride_tricks.as_strided(
            backing[t.offset_bytes :], shape=t.shape_bytes, strides=t.stride_bytes
        )
        out[name] = HostTensor(raw.view(np.dtype(f"u{t.element_size}")))
    return out


def torch_views(fx: KVFixture, backing: Any) -> dict[str, Any]:
    """The fixture's layer tensors over ``backing`` (a uint8 torch tensor), built as vLLM
    builds them: a strided byte view, then reinterpreted as the layer's dtype."""
    import torch

    out = {}
    for name, t in fx.tensors.items():
        raw = torch.as_strided(
            backing, t.shape_bytes, t.stride_bytes, backing.storage_offset() + t.offset_bytes
        )
        view = raw.view(getattr(torch, t.dtype))
        if tuple(view.shape) != t.shape or tuple(view.stride()) != t.stride:
            raise ValueError(
                f"{name}: rebuilt view {tuple(view.shape)}/{view.stride()} is "
                f"not the fixture's {t.shape}/{t.stride}"
            )
        out[name] = view
    return out


@dataclass(frozen=True, slots=True)
class PageCopy:
    """``nbytes`` at ``src`` copied to ``dst`` (byte offsets in buffer ``buffer``)."""

    group: str
    layer: str
    buffer: int
    src: int
    dst: int
    nbytes: int


def expected_copies(
    groups: Sequence[GroupSpec],
    chunk_size: int,
    n_chunks: int,
    src_ids: Mapping[str, np.ndarray],
    dst_ids: Mapping[str, np.ndarray],
) -> list[PageCopy]:
    """The pages a retrieve of ``n_chunks`` chunks stored from ``src_ids`` writes into
    ``dst_ids`` (both per server group, in chunk order)."""
    out = []
    for g in groups:
        if not g.cached:
            continue
        bpc = blocks_per_chunk(g, chunk_size)
        blocks = np.arange(n_chunks * bpc).reshape(n_chunks, bpc)
        if g.kind == "sliding_window":
            n_win_blocks = min(bpc, math.ceil(g.window_tokens / g.tokens_per_block))
            n_win_chunks = math.ceil(g.window_tokens / chunk_size)
            blocks = blocks[max(0, n_chunks - n_win_chunks) :, bpc - n_win_blocks :]
        src, dst = np.asarray(src_ids[g.name]), np.asarray(dst_ids[g.name])
        for j in blocks.reshape(-1):
            if dst[j] < 0 or src[j] < 0:
                continue
            for layer in g.layers:
                out.append(
                    PageCopy(
                        g.name,
                        layer.name,
                        layer.buffer,
                        layer.offset + int(src[j]) * layer.block_stride,
                        layer.offset + int(dst[j]) * layer.block_stride,
                        layer.page_bytes,
                    )
                )
    return out


def describe_byte(groups: Sequence[GroupSpec], offset: int) -> str:
    """Which pages (group, layer, block) hold byte ``offset`` of buffer 0, for messages."""
    hits = []
    for g in groups:
        for layer in g.layers:
            if layer.buffer != 0 or offset < layer.offset:
                continue
            block, within = divmod(offset - layer.offset, layer.block_stride)
            if block < g.num_blocks and within < layer.page_bytes:
                hits.append(f"{g.name}/{layer.name} block {block}")
    return ", ".join(hits) or "no page"


class Backing(Protocol):
    """One backing allocation holding a fixture's KV cache, and byte-exact checks on it.

    ``snapshot`` returns an opaque copy; ``apply`` a copy of a snapshot with pages
    copied; ``first_difference`` the first byte offset where two snapshots differ
    (``None``: identical); ``ready`` what to wait on before a store (``None`` on hosts).
    """

    size_bytes: int

    def views(self, fx: KVFixture) -> dict[str, Any]: ...

    def fill_random(self, seed: int) -> None: ...

    def snapshot(self) -> Any: ...

    def apply(self, before: Any, copies: Sequence[PageCopy]) -> Any: ...

    def first_difference(self, a: Any, b: Any) -> int | None: ...

    def ready(self) -> Callable[[], None] | None: ...


def first_difference_np(a: np.ndarray, b: np.ndarray) -> int | None:
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else None


class ShmBacking:
    """The backing allocation in POSIX shared memory, reachable by the CPU engine."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.segment = ShmSegment(size_bytes)
        register_shm_segment(self.segment)

    def views(self, fx: KVFixture) -> dict[str, Any]:
        if fx.backing_size_bytes > self.size_bytes:
            raise ValueError(f"{fx.name} needs {fx.backing_size_bytes} bytes")
        return dict(host_views(fx, self.segment.array))

    def fill_random(self, seed: int) -> None:
        fill_random_bytes([self.segment.array], seed)

    def snapshot(self) -> np.ndarray:
        return self.segment.array.copy()

    def apply(self, before: np.ndarray, copies: Sequence[PageCopy]) -> np.ndarray:
        out = before.copy()
        for c in copies:
            out[c.dst : c.dst + c.nbytes] = before[c.src : c.src + c.nbytes]
        return out

    def first_difference(self, a: np.ndarray, b: np.ndarray) -> int | None:
        return first_difference_np(a, b)

    def ready(self) -> Callable[[], None] | None:
        return None

    def close(self) -> None:
        unregister_shm_segment(self.segment)
        self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
