"""Object-group layout: which engine groups' pages of one chunk form one object.

With ``separate=True`` (``--separate-object-groups``) there is one object group per
distinct retention need: ``full`` (every full-attention group, e.g. DeepSeek-V4.1's
compressed KV and its indexer) and ``window<W>`` per distinct sliding window W. Without
it, one object group ``all`` holds every cached group of a chunk. Scratch groups never
appear in any object.

Inside an object, each *section* (one engine group) stores the pages of the blocks a
future hit can use: every block of the chunk for full groups, only the trailing
``ceil(W / tokens_per_block)`` blocks for a sliding window of W tokens (all of them if
W >= chunk size). Object byte layout::

    object  = section_0 | section_1 | ...
    section = block_first | ... | block_last         (the stored blocks, block-major)
    block   = page(layer_0) | page(layer_1) | ...    (in the order the worker declared)

Block-major is object format 2 (format 1 was layer-major): vLLM lays DeepSeek-V4's KV
out block-outermost (every layer of a block side by side in one allocation), so each
stored block of a section is then one contiguous range both in the worker's memory and
in the object, which is what lets the copy engines move it in one DMA (docs/gpu.md). A
layer-outermost worker (a tensor per layer, or the test preset) moves the same bytes
with one strided 2-D copy per block. Layers of one group that sit in the same buffer at
a constant distance from each other are coalesced into one :class:`LayerRun`, so a copy
touches ``runs x chunks`` descriptors, not pages; how layers coalesce changes no byte of
the object.

The *fingerprint* of an object group hashes everything that decides its byte layout
and meaning (the object format, kinds, windows, tokens and states per block, record
formats, page bytes per layer) but nothing about where the worker keeps its pages: two
workers with the same model and geometry share objects even if their buffers are laid
out differently, and the scheduler's placement-free registration agrees with them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lmc_server.cache.geometry import GroupSpec, blocks_per_chunk
from lmc_server.cache.retention import Retention, object_retentions, retention_kind

#: Hashed into every fingerprint: objects of another byte order (format 1 stored runs
#: layer-major) are foreign to this one, so an L2 or disk tier written by an older
#: server is a miss, never misread.
OBJECT_FORMAT = "objects-v2-block-major"


@dataclass(frozen=True, slots=True)
class LayerRun:
    """``n_layers`` layers of one group in one buffer, ``layer_stride`` bytes apart.

    Page of layer ``i`` (of the run) and block id ``b`` is at buffer offset
    ``base_offset + i * layer_stride + b * block_stride``; in the object, page ``(i, j)``
    (stored block ``j``) is at ``object_offset + i * object_layer_stride + j *
    object_block_stride``. Built by :func:`build_layout` block-major (the run is one
    slice of each of its section's blocks); ``obj_layer_stride == 0`` means a run laid
    out on its own, layer-major (``[layer][stored block]``, ``nbytes`` contiguous).
    """

    buffer: int
    base_offset: int
    layer_stride: int
    n_layers: int
    block_stride: int
    page_bytes: int
    object_offset: int
    n_blocks: int
    obj_layer_stride: int = 0
    obj_block_stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.n_layers * self.n_blocks * self.page_bytes

    @property
    def object_layer_stride(self) -> int:
        return self.obj_layer_stride or self.n_blocks * self.page_bytes

    @property
    def object_block_stride(self) -> int:
        return self.obj_block_stride or self.page_bytes

    @property
    def object_extent(self) -> int:
        """Bytes from ``object_offset`` to the end of the run's last page (the run's
        pages and, block-major, the other runs' pages between them)."""
        return (
            (self.n_layers - 1) * self.object_layer_stride
            + (self.n_blocks - 1) * self.object_block_stride
            + self.page_bytes
        )


@dataclass(frozen=True, slots=True)
class SectionLayout:
    """One engine group's part of an object.

    ``window_tokens == 0`` marks a full-prefix section. ``first_block`` and
    ``n_blocks`` select the blocks of the chunk that are stored (block indices
    relative to the chunk, ``0 <= first_block < blocks_per_chunk``).
    """

    group_index: int
    group_name: str
    window_tokens: int
    blocks_per_chunk: int
    first_block: int
    n_blocks: int
    object_offset: int
    nbytes: int
    runs: tuple[LayerRun, ...]

    @property
    def is_window(self) -> bool:
        return self.window_tokens > 0


@dataclass(frozen=True, slots=True)
class ObjectGroupLayout:
    """The fixed byte layout of one object group's objects (one per chunk).

    ``retentions`` holds the hit rule of its sections, one object per section kind
    (:mod:`lmc_server.cache.retention`), required ones first; ``required_bits`` lists
    the sections an object must have to be stored (derived from ``retentions``, kept
    because every store reads it).
    """

    name: str
    index: int
    sections: tuple[SectionLayout, ...]
    object_bytes: int
    fingerprint: bytes
    retentions: tuple[Retention, ...]
    required_bits: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        covered = sorted(b for r in self.retentions for b in r.bits)
        assert covered == list(range(len(self.sections))), (
            f"object group {self.name!r}: the retentions must cover each section once"
        )
        object.__setattr__(
            self, "required_bits", tuple(b for r in self.retentions if r.required for b in r.bits)
        )

    @property
    def has_full(self) -> bool:
        """Whether the group has full-attention sections (the required ones)."""
        return bool(self.required_bits)


@dataclass(frozen=True, slots=True)
class RegistrationLayout:
    """All object groups of one registration, and the window rule per window size.

    ``windows`` maps each sliding window size W to the number of trailing chunks of a
    prefix that a hit needs for it (``ceil(W / chunk_size)``).
    """

    chunk_size: int
    object_groups: tuple[ObjectGroupLayout, ...]
    windows: dict[int, int] = field(default_factory=dict)

    @property
    def chunk_bytes(self) -> int:
        return sum(og.object_bytes for og in self.object_groups)


def _coalesce_runs(group: GroupSpec, n_blocks: int, start_offset: int) -> tuple[LayerRun, ...]:
    """Runs of consecutive declared layers (same buffer, block stride and page size, a
    constant distance apart), placed block-major in a section starting at
    ``start_offset``: a stored block holds every layer's page in declared order."""
    layers = group.layers
    block_bytes = sum(layer.page_bytes for layer in layers)
    runs: list[LayerRun] = []
    prefix = 0
    i = 0
    while i < len(layers):
        first = layers[i]
        n = 1
        stride = 0
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            if (
                nxt.buffer == first.buffer
                and nxt.block_stride == first.block_stride
                and nxt.page_bytes == first.page_bytes
                and nxt.offset != first.offset
            ):
                stride = nxt.offset - first.offset
                n = 2
                while i + n < len(layers):
                    cand = layers[i + n]
                    if (
                        cand.buffer != first.buffer
                        or cand.block_stride != first.block_stride
                        or cand.page_bytes != first.page_bytes
                        or cand.offset != first.offset + n * stride
                    ):
                        break
                    n += 1
        runs.append(
            LayerRun(
                buffer=first.buffer,
                base_offset=first.offset,
                layer_stride=stride,
                n_layers=n,
                block_stride=first.block_stride,
                page_bytes=first.page_bytes,
                object_offset=start_offset + prefix,
                n_blocks=n_blocks,
                obj_layer_stride=first.page_bytes,
                obj_block_stride=block_bytes,
            )
        )
        prefix += n * first.page_bytes
        i += n
    return tuple(runs)


def _section(group: GroupSpec, index: int, chunk_size: int, offset: int) -> SectionLayout:
    bpc = blocks_per_chunk(group, chunk_size)
    n_blocks = retention_kind(group).stored_blocks(group, bpc)
    window = group.window_tokens if group.kind == "sliding_window" else 0
    runs = _coalesce_runs(group, n_blocks, offset)
    nbytes = sum(r.nbytes for r in runs)
    return SectionLayout(
        group_index=index,
        group_name=group.name,
        window_tokens=window,
        blocks_per_chunk=bpc,
        first_block=bpc - n_blocks,
        n_blocks=n_blocks,
        object_offset=offset,
        nbytes=nbytes,
        runs=runs,
    )


def _fingerprint(name: str, groups: list[GroupSpec], sections: list[SectionLayout]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(OBJECT_FORMAT.encode())
    h.update(name.encode())
    for s in sections:
        g = groups[s.group_index]
        pages = ",".join(str(layer.page_bytes) for layer in g.layers)
        h.update(
            f"|{g.kind}:{g.window_tokens}:{g.tokens_per_block}:{g.states_per_block}:"
            f"{g.record_format}:{g.bytes_per_state}:{s.first_block}:{s.n_blocks}:"
            f"[{pages}]".encode()
        )
    return h.digest()


def build_layout(groups: list[GroupSpec], chunk_size: int, separate: bool) -> RegistrationLayout:
    """Partition cached groups into object groups and fix every object's byte layout.

    Assumes :func:`lmc_server.cache.geometry.check_groups` passed. Object groups are
    ordered ``full`` first, then windows ascending, so their order is stable.
    """
    buckets: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        if not g.cached:
            continue
        if not separate:
            name = "all"
        elif g.kind == "sliding_window":
            name = f"window{g.window_tokens}"
        else:
            name = "full"
        buckets.setdefault(name, []).append(i)

    def order(name: str) -> tuple[int, int]:
        return (0, 0) if name in ("full", "all") else (1, int(name[len("window") :]))

    ogs: list[ObjectGroupLayout] = []
    for og_index, name in enumerate(sorted(buckets, key=order)):
        sections: list[SectionLayout] = []
        offset = 0
        for gi in buckets[name]:
            sec = _section(groups[gi], gi, chunk_size, offset)
            sections.append(sec)
            offset += sec.nbytes
        retentions = object_retentions([groups[gi] for gi in buckets[name]], chunk_size)
        ogs.append(
            ObjectGroupLayout(
                name=name,
                index=og_index,
                sections=tuple(sections),
                object_bytes=offset,
                fingerprint=_fingerprint(name, groups, sections),
                retentions=retentions,
            )
        )
    windows = {
        g.window_tokens: math.ceil(g.window_tokens / chunk_size)
        for g in groups
        if g.cached and g.kind == "sliding_window"
    }
    return RegistrationLayout(chunk_size=chunk_size, object_groups=tuple(ogs), windows=windows)


@dataclass(frozen=True, slots=True)
class RunCopy:
    """One layer run copied for ``m`` chunks: the unit a transfer engine executes.

    ``block_ids[c, j]`` is the engine block id of stored block ``j`` of chunk ``c``
    (``-1``: leave that block alone, retrieve only). ``object_offsets[c]`` is the pool
    byte offset of ``run.object_offset`` inside chunk ``c``'s object.
    """

    run: LayerRun
    block_ids: np.ndarray
    object_offsets: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.block_ids.shape[0]) * self.run.nbytes


def section_block_ids(section: SectionLayout, group_ids: np.ndarray) -> np.ndarray:
    """The stored blocks' ids per chunk: ``group_ids`` is ``(chunks, blocks_per_chunk)``."""
    return group_ids[:, section.first_block : section.first_block + section.n_blocks]


def plan_copies(
    section: SectionLayout, ids: np.ndarray, object_offsets: np.ndarray
) -> list[RunCopy]:
    """Copy descriptors for one section of ``len(object_offsets)`` objects.

    ``ids`` is the section's ``(m, n_blocks)`` stored block ids, ``object_offsets`` the
    pool offsets of the ``m`` objects. Vectorized: no per-page Python objects.
    """
    return [
        RunCopy(
            run=r,
            block_ids=ids,
            object_offsets=object_offsets + r.object_offset if r.object_offset else object_offsets,
        )
        for r in section.runs
    ]


def plan_objects(
    og: ObjectGroupLayout,
    offsets: np.ndarray,
    chunks: np.ndarray | None,
    sections: Sequence[np.ndarray] | None,
    group_ids: dict[int, np.ndarray],
    out: list[RunCopy],
) -> int:
    """Append the copies of objects ``chunks`` of ``og`` to ``out``; returns their bytes.

    ``offsets[j]`` is the pool offset of chunk ``chunks[j]``'s object, ``sections[bit][i]``
    says whether section ``bit`` of request chunk ``i`` is copied, ``group_ids[g]`` is
    engine group ``g``'s ``(chunks, blocks_per_chunk)`` block ids. ``chunks`` None:
    every chunk of the request, in order; ``sections`` None: every section of every
    chunk in ``chunks`` (the usual store and retrieve, planned without a selection:
    the copies then read the request's block-id arrays through views).
    """
    nbytes = 0
    for bit, sec in enumerate(og.sections):
        ids = section_block_ids(sec, group_ids[sec.group_index])
        if sections is None:
            offs = offsets
            if chunks is not None:
                ids = ids[chunks]
        else:
            sel = sections[bit] if chunks is None else sections[bit][chunks]
            if sel.all():
                offs = offsets
                if chunks is not None:
                    ids = ids[chunks]
            elif not sel.any():
                continue
            else:
                offs = offsets[sel]
                ids = ids[sel] if chunks is None else ids[chunks[sel]]
        for c in plan_copies(sec, ids, offs):
            out.append(c)
            nbytes += c.nbytes
    return nbytes
