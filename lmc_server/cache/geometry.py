"""Engine-group geometry as a worker declares it, and the rules it must satisfy.

A worker registers one :class:`GroupSpec` per engine KV cache group. Each group lists
where its pages are (:class:`LayerSpec`: buffer, offset, block stride, page bytes).
The server never interprets record bytes; it only needs sizes, strides and rules:

* the chunk-size rule (:func:`check_chunk_size`): for every non-scratch group, the
  chunk size is a multiple of tokens per block, and tokens per block is a multiple of
  tokens per stored state;
* record-format rules (:func:`check_record_format`): architecture-dependent formats
  must match the architecture (``nvfp4_ds_mla`` only on SM100, the 584/528-byte
  ``fp8_ds_mla`` records on their own architectures);
* bounds (:func:`check_layer_bounds`): every page of every block lies inside its
  buffer, pages of one layer do not overlap;
* aliasing (:func:`check_page_overlaps`): no two layers share a byte, within a group or
  across groups (scratch included), except pages of different groups for the same block
  id (groups sharing a buffer share one block-id space, as in vLLM's hybrid allocator).

Violations raise :class:`GeometryError` with a message naming the group and the numbers.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import msgspec

from lmc_server.cache.overlap import Pages, candidate_pairs, overlap
from lmc_server.errors import LmcError

GroupKind = Literal["full", "sliding_window", "scratch"]

#: Largest number of groups, layers per group, buffers, and blocks per group a
#: registration may declare. Bounds the work a single registration can cause.
MAX_GROUPS = 64
MAX_LAYERS_PER_GROUP = 1024
MAX_BUFFERS = 4096
MAX_BLOCKS_PER_GROUP = 1 << 24
#: Largest number of layers over all groups, and of pairs of layers with different block
#: strides whose extents intersect in one buffer (each costs an O(log) test, ~25 us): they
#: bound the overlap check (about 20 ms for 1024 layers of 100k blocks, interleaved or
#: layer-major; at most ~0.5 s of unequal-stride pairs), which runs on the event loop.
MAX_LAYERS = 1024
MAX_UNEQUAL_STRIDE_PAIRS = 20_000


class GeometryError(LmcError, ValueError):
    """A registration's geometry breaks a rule; the message names group and numbers."""


class ArchError(GeometryError):
    """A record format is not valid on the registering device's architecture."""


class LayerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one layer's pages of one engine group live.

    Page ``b`` (block id ``b``) of this layer occupies bytes
    ``[offset + b * block_stride, offset + b * block_stride + page_bytes)`` of buffer
    ``buffer`` (an index into the registration's buffer list).
    """

    buffer: int
    offset: int
    block_stride: int
    page_bytes: int
    name: str = ""


class GroupSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine KV cache group: one block-id space, one block size.

    ``tokens_per_block / states_per_block`` tokens are packed into one stored state
    (2 for DeepSeek-V4.1's compressed KV). ``window_tokens`` is set only for
    ``sliding_window`` groups. Scratch groups (per-request rings that are never
    prefix-cacheable) are accepted and then skipped end to end.
    """

    name: str
    kind: GroupKind
    tokens_per_block: int
    states_per_block: int
    record_format: str
    bytes_per_state: int
    num_blocks: int
    layers: list[LayerSpec]
    window_tokens: int = 0

    @property
    def cached(self) -> bool:
        return self.kind != "scratch"


#: Architecture-dependent records: format -> {arch: required bytes per state}; the
#: key ``"*"`` is the rule for every arch not listed. ``None`` means refused.
_ARCH_RECORDS: dict[str, dict[str, int | None]] = {
    "fp8_ds_mla": {"sm100": 528, "*": 584},
}
#: Formats that exist only on some architectures (size as the engine reports).
_ARCH_ONLY: dict[str, frozenset[str]] = {
    "nvfp4_ds_mla": frozenset({"sm100"}),
}
#: Formats whose size does not depend on the arch but is fixed.
_FIXED_RECORDS: dict[str, int] = {"indexer_fp8": 132}


class BlockSized(Protocol):
    """Anything that says its block size and whether it is cached: :class:`GroupSpec`,
    and the engine-side group descriptions of the client and the integration."""

    @property
    def tokens_per_block(self) -> int: ...

    @property
    def cached(self) -> bool: ...


def blocks_per_chunk(group: BlockSized, chunk_size: int) -> int:
    """Engine blocks of ``group`` in one chunk: the block ids a request carries per chunk.

    ``chunk_size // tokens_per_block`` for a cached group (the chunk-size rule makes it
    exact), 0 for a scratch group (never stored, never sent block ids). The one
    definition: the server, the client, the integration and the test helpers call it.
    """
    return chunk_size // group.tokens_per_block if group.cached else 0


def tokens_per_state(group: GroupSpec) -> int:
    """Tokens packed into one stored state (1 for ordinary KV)."""
    return group.tokens_per_block // group.states_per_block


def smallest_chunk_size(groups: list[GroupSpec]) -> int:
    """Least common multiple of the tokens per block of every cached group."""
    sizes = [g.tokens_per_block for g in groups if g.cached and g.tokens_per_block > 0]
    return math.lcm(*sizes) if sizes else 1


def check_chunk_size(chunk_size: int, groups: list[GroupSpec]) -> None:
    """Enforce the chunk-size rule; scratch groups are skipped.

    Raises :class:`GeometryError` naming the first offending group, both numbers and
    the smallest chunk size that satisfies every cached group.
    """
    for g in groups:
        if not g.cached:
            continue
        if g.tokens_per_block <= 0 or g.states_per_block <= 0:
            raise GeometryError(
                f"group {g.name!r}: tokens_per_block ({g.tokens_per_block}) and "
                f"states_per_block ({g.states_per_block}) must be positive"
            )
        if g.tokens_per_block % g.states_per_block:
            raise GeometryError(
                f"group {g.name!r}: tokens_per_block {g.tokens_per_block} is not a "
                f"multiple of tokens per stored state (states_per_block "
                f"{g.states_per_block} does not divide it)"
            )
        if chunk_size % g.tokens_per_block:
            raise GeometryError(
                f"chunk size {chunk_size} is not a multiple of group {g.name!r}'s "
                f"tokens_per_block {g.tokens_per_block}; the smallest chunk size that "
                f"works for every cached group is {smallest_chunk_size(groups)} "
                f"(or any multiple of it)"
            )


def check_record_format(group: GroupSpec, arch: str) -> None:
    """Refuse architecture-dependent records that do not match ``arch``."""
    fmt = group.record_format
    if fmt in _ARCH_ONLY and arch not in _ARCH_ONLY[fmt]:
        allowed = ", ".join(sorted(_ARCH_ONLY[fmt]))
        raise ArchError(
            f"group {group.name!r}: record format {fmt!r} is only valid on {allowed}, not on {arch}"
        )
    if fmt in _ARCH_RECORDS:
        rule = _ARCH_RECORDS[fmt]
        want = rule.get(arch, rule.get("*"))
        if want is not None and group.bytes_per_state != want:
            raise ArchError(
                f"group {group.name!r}: record format {fmt!r} on {arch} has {want} bytes "
                f"per state, registration says {group.bytes_per_state}"
            )
    if fmt in _FIXED_RECORDS and group.bytes_per_state != _FIXED_RECORDS[fmt]:
        raise GeometryError(
            f"group {group.name!r}: record format {fmt!r} has {_FIXED_RECORDS[fmt]} bytes "
            f"per state, registration says {group.bytes_per_state}"
        )


def check_layer_bounds(group: GroupSpec, buffer_sizes: list[int]) -> None:
    """Every page of every block of every layer lies inside its buffer."""
    if not 0 < group.num_blocks <= MAX_BLOCKS_PER_GROUP:
        raise GeometryError(
            f"group {group.name!r}: num_blocks {group.num_blocks} out of range "
            f"1..{MAX_BLOCKS_PER_GROUP}"
        )
    min_page = group.states_per_block * group.bytes_per_state if group.cached else 1
    for i, layer in enumerate(group.layers):
        where = f"group {group.name!r} layer {i}{' (' + layer.name + ')' if layer.name else ''}"
        if not 0 <= layer.buffer < len(buffer_sizes):
            raise GeometryError(
                f"{where}: buffer index {layer.buffer} out of range 0..{len(buffer_sizes) - 1}"
            )
        if layer.offset < 0 or layer.page_bytes <= 0:
            raise GeometryError(f"{where}: offset must be >= 0 and page_bytes > 0")
        if layer.page_bytes < min_page:
            raise GeometryError(
                f"{where}: page_bytes {layer.page_bytes} is smaller than states_per_block "
                f"x bytes_per_state = {group.states_per_block} x {group.bytes_per_state} "
                f"= {min_page}"
            )
        if group.num_blocks > 1 and layer.block_stride < layer.page_bytes:
            raise GeometryError(
                f"{where}: block_stride {layer.block_stride} is smaller than page_bytes "
                f"{layer.page_bytes}: pages of consecutive blocks would overlap"
            )
        end = layer.offset + (group.num_blocks - 1) * layer.block_stride + layer.page_bytes
        size = buffer_sizes[layer.buffer]
        if end > size:
            raise GeometryError(
                f"{where}: last block ends at byte {end} but buffer {layer.buffer} has {size} bytes"
            )


def check_groups(
    groups: list[GroupSpec], chunk_size: int, arch: str, buffer_sizes: list[int] | None
) -> None:
    """All registration-time geometry rules, in the order a user would fix them.

    ``buffer_sizes`` is ``None`` for a lookup-only registration (no buffers): layer
    bounds are then not checked, since nothing will ever be copied.
    """
    if not groups:
        raise GeometryError("registration declares no groups")
    if len(groups) > MAX_GROUPS:
        raise GeometryError(f"{len(groups)} groups declared; at most {MAX_GROUPS}")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise GeometryError(f"group names must be unique, got {names}")
    if not any(g.cached for g in groups):
        raise GeometryError("every group is scratch: nothing to cache")
    check_chunk_size(chunk_size, groups)
    for g in groups:
        if not g.cached:
            continue
        if g.kind == "sliding_window" and g.window_tokens <= 0:
            raise GeometryError(f"group {g.name!r}: sliding_window groups need window_tokens > 0")
        if g.kind == "full" and g.window_tokens:
            raise GeometryError(f"group {g.name!r}: window_tokens is only for sliding_window")
        if not g.layers:
            raise GeometryError(f"group {g.name!r} declares no layers")
        if len(g.layers) > MAX_LAYERS_PER_GROUP:
            raise GeometryError(
                f"group {g.name!r}: {len(g.layers)} layers; at most {MAX_LAYERS_PER_GROUP}"
            )
        if g.bytes_per_state <= 0:
            raise GeometryError(f"group {g.name!r}: bytes_per_state must be positive")
        check_record_format(g, arch)
        if buffer_sizes is None and not 0 < g.num_blocks <= MAX_BLOCKS_PER_GROUP:
            raise GeometryError(f"group {g.name!r}: num_blocks {g.num_blocks} out of range")
    if buffer_sizes is None:
        return
    total = sum(len(g.layers) for g in groups)
    if total > MAX_LAYERS:
        raise GeometryError(f"{total} layers declared over all groups; at most {MAX_LAYERS}")
    for g in groups:
        if g.cached or g.layers:  # scratch layers too: the server must never write there
            check_layer_bounds(g, buffer_sizes)
    check_page_overlaps(groups)


def _layer_name(group: GroupSpec, i: int) -> str:
    layer = group.layers[i]
    return f"group {group.name!r} layer {i}{' (' + layer.name + ')' if layer.name else ''}"


def check_page_overlaps(groups: list[GroupSpec]) -> None:
    """Refuse any two layers whose pages share a byte (see :mod:`lmc_server.cache.overlap`).

    Layers of different groups may coincide for the same block id only (one block-id
    space per buffer, a block owned by one group at a time); everything else, within a
    group or across groups, scratch included, is refused naming both layers. Layers with
    identical pages in different groups (vLLM lays groups over one tensor) are merged
    first; sweeps (:func:`~lmc_server.cache.overlap.candidate_pairs`) pick the pairs that
    can overlap, each then tested in O(1) (equal strides) or O(log) (unequal).
    Bounds must have been checked (positive page bytes, stride >= page bytes).
    """
    # (buffer, offset, stride, page) -> (blocks, [(group, layer), ...]).
    merged: dict[tuple[int, int, int, int], tuple[int, list[tuple[int, int]]]] = {}
    for gi, g in enumerate(groups):
        for li, layer in enumerate(g.layers):
            key = (layer.buffer, layer.offset, layer.block_stride, layer.page_bytes)
            n, members = merged.get(key, (0, []))
            twin = next((lj for gj, lj in members if gj == gi), None)
            if twin is not None:
                raise GeometryError(
                    f"{_layer_name(g, twin)} and {_layer_name(g, li)} have the same pages "
                    f"(buffer {layer.buffer}, offset {layer.offset}): every block would "
                    f"alias"
                )
            members.append((gi, li))
            merged[key] = (max(n, g.num_blocks), members)
    by_buffer: dict[int, list[tuple[Pages, list[tuple[int, int]]]]] = {}
    for (buf, off, stride, page), (n, members) in merged.items():
        by_buffer.setdefault(buf, []).append((Pages(off, stride, page, n), members))
    for buf, entries in by_buffer.items():
        entries.sort(key=lambda e: e[0].offset)  # "first" in messages: the lower offset
        owners = [{gi for gi, _ in members} for _, members in entries]
        unequal = 0
        for x, y in candidate_pairs([p for p, _ in entries]):
            i, j = min(x, y), max(x, y)
            a, b = entries[j][0], entries[i][0]
            if a.stride != b.stride and a.n > 1 and b.n > 1:
                unequal += 1
                if unequal > MAX_UNEQUAL_STRIDE_PAIRS:
                    raise GeometryError(
                        f"buffer {buf}: more than {MAX_UNEQUAL_STRIDE_PAIRS} pairs of layers "
                        f"with different block strides share a region; too many to check "
                        f"for overlaps (give such groups their own buffers)"
                    )
            shared = owners[i] & owners[j]
            hit = overlap(a, b, same_block_ok=not shared)
            if hit is None:
                continue
            # Name layers of the group they share, if any (that is the alias).
            gj, lj = next(m for m in entries[j][1] if not shared or m[0] in shared)
            gi, li = next(m for m in entries[i][1] if not shared or m[0] == gj)
            k_j, k_i = hit
            where = (
                f"block {k_i} of the first and block {k_j} of the second share bytes"
                if k_j >= 0
                else "their pages share bytes for some blocks"
            )
            raise GeometryError(
                f"{_layer_name(groups[gi], li)} and "
                f"{_layer_name(groups[gj], lj)} overlap in buffer {buf}: {where}; "
                f"stores and retrieves would alias KV"
            )
