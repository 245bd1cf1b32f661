"""Chunk arithmetic over an engine's block tables: which blocks hold a chunk, its digest.

A chunk is ``chunk_size`` tokens. The engine hashes every ``hash_block_size`` tokens
(vLLM's block hashes, already chained and salted with the request's cache salt, LoRA
and multimodal inputs); the digest of chunk ``k`` chains the concatenated hashes of its
blocks onto the digest of chunk ``k - 1``
(:func:`lmc_server.client.digests.hash_chain`), so equal digests mean equal prefixes.

Pure functions of the engine's geometry (no request state, no vLLM, no IO): the
scheduler-side planner (:mod:`lmc_server.integration.planning`) asks which block ids to
send and which blocks a sliding window has freed; the registration
(:mod:`lmc_server.integration.kvlayout`) reads the groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.client.digests import hash_chain
from lmc_server.protocol.messages import StoreEvents

NULL_BLOCK_ID = 0
"""vLLM's null block (block 0 of its pool): a placeholder, never real KV."""


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """One engine KV cache group as the planner needs it.

    ``cached`` is False for scratch groups (never stored, never sent block ids).
    ``window_tokens`` > 0 marks a sliding-window group. ``server_groups`` names the
    server groups this block table drives when there are several (layers with
    different records under one block table, :mod:`lmc_server.integration.kvlayout`);
    empty means one server group named ``name``.
    """

    name: str
    tokens_per_block: int
    cached: bool = True
    window_tokens: int = 0
    server_groups: tuple[str, ...] = ()

    @property
    def block_id_keys(self) -> tuple[str, ...]:
        """The server groups that receive this group's block ids."""
        return self.server_groups or (self.name,)


class ChunkGeometry:
    """Chunk arithmetic over an engine's groups and block hashes."""

    def __init__(
        self, chunk_size: int, hash_block_size: int, groups: Sequence[EngineGroup]
    ) -> None:
        if chunk_size <= 0 or hash_block_size <= 0 or chunk_size % hash_block_size:
            raise ValueError(
                f"chunk size {chunk_size} must be a positive multiple of the "
                f"engine's hash block size {hash_block_size}"
            )
        for g in groups:
            if g.cached and chunk_size % g.tokens_per_block:
                raise ValueError(
                    f"chunk size {chunk_size} is not a multiple of group "
                    f"{g.name!r}'s {g.tokens_per_block} tokens per block"
                )
        self.chunk_size = chunk_size
        self.hash_block_size = hash_block_size
        self.groups = tuple(groups)
        self.hashes_per_chunk = chunk_size // hash_block_size
        #: (index, group, blocks per chunk) of each cached group, for the per-request paths
        self._cached = [
            (gi, g, blocks_per_chunk(g, chunk_size)) for gi, g in enumerate(self.groups) if g.cached
        ]

    def blocks_per_chunk(self, group: EngineGroup) -> int:
        return blocks_per_chunk(group, self.chunk_size)

    @staticmethod
    def freed_blocks(group: EngineGroup, num_computed_tokens: int) -> int:
        """Leading blocks of ``group`` the engine may have freed at this many computed
        tokens: 0 for full groups; for a window of W tokens, the blocks wholly below
        ``num_computed_tokens - W + 1`` (vLLM 0.33 ``SlidingWindowManager``: the
        skipped tokens no later token attends to, freed by ``remove_skipped_blocks``
        when the request is next scheduled)."""
        if not group.cached or not group.window_tokens:
            return 0
        return max(0, num_computed_tokens - group.window_tokens + 1) // group.tokens_per_block

    def max_chunks(self, num_tokens: int, num_hashes: int) -> int:
        """Chunks a hit may cover: whole chunks, never the last token, hashed."""
        return min(max(0, num_tokens - 1) // self.chunk_size, num_hashes // self.hashes_per_chunk)

    def digests(self, block_hashes: Sequence[bytes], n_chunks: int, known: bytes = b"") -> bytes:
        """Prefix-chained digests of the first ``n_chunks`` chunks. ``known``: digests of
        leading chunks computed before from the same hashes; only the rest is hashed."""
        per = self.hashes_per_chunk
        if len(block_hashes) < n_chunks * per:
            raise ValueError(
                f"{len(block_hashes)} block hashes cannot cover {n_chunks} chunks of {per} hashes"
            )
        have = min(len(known) // DIGEST_BYTES, n_chunks)
        if have == n_chunks:
            return known[: n_chunks * DIGEST_BYTES]
        seed = {"seed": known[(have - 1) * DIGEST_BYTES : have * DIGEST_BYTES]} if have else {}
        # bytes.join takes the hashes as they are (bytes-like): no copy of each one
        return known[: have * DIGEST_BYTES] + hash_chain(
            [b"".join(block_hashes[k * per : (k + 1) * per]) for k in range(have, n_chunks)], **seed
        )

    def store_events(
        self,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        first_chunk: int,
        n_chunks: int,
    ) -> StoreEvents:
        """What a KV-event subscriber needs of chunks ``first_chunk..+n_chunks`` (the
        server's ``events`` fields): their tokens, each engine block hash reduced to 64
        bits as vLLM publishes it (the last 8 bytes, big-endian: vLLM's
        ``maybe_convert_block_hash``), and the hash of the block before each chunk."""
        per, cs = self.hashes_per_chunk, self.chunk_size
        end = first_chunk + n_chunks

        def short(i: int) -> bytes:
            return bytes(block_hashes[i])[-8:]

        mine = [short(i) for i in range(first_chunk * per, end * per)]
        parents = [short(c * per - 1) if c else bytes(8) for c in range(first_chunk, end)]
        tokens = np.asarray(
            token_ids[first_chunk * cs : (first_chunk + n_chunks) * cs], dtype="<u4"
        )
        return StoreEvents(
            block_size=self.hash_block_size,
            token_ids=tokens.tobytes(),
            block_hashes=b"".join(mine),
            parent_hashes=b"".join(parents),
        )

    def block_ids(
        self,
        group_blocks: Sequence[Sequence[int]],
        first_chunk: int,
        n_chunks: int,
        keep_tokens: int = 0,
        computed_tokens: int = 0,
    ) -> dict[str, np.ndarray]:
        """Per cached server group, the block ids of chunks ``first_chunk..+n_chunks``.

        ``group_blocks[i]`` is the request's block table of engine group ``i``; every
        server group of an engine group gets the same ids. Blocks whose tokens all lie
        below ``keep_tokens`` (the engine already holds them), blocks the engine may
        have freed at ``computed_tokens`` (:meth:`freed_blocks`), the null block and
        blocks past the table's end become ``-1``.
        """
        out: dict[str, np.ndarray] = {}
        for gi, g, bpc in self._cached:
            lo = first_chunk * bpc
            n = n_chunks * bpc
            # one array from the table's slice (the usual case: the table covers the
            # chunks and holds no null block) rather than a fill and masks: this runs
            # per request on the scheduler thread, where each numpy call costs a few µs
            have = group_blocks[gi][lo : lo + n]
            ids = np.array(have, dtype=np.int32)
            if len(have) < n:
                ids = np.concatenate([ids, np.full(n - len(have), -1, dtype=np.int32)])
            if NULL_BLOCK_ID in have:
                ids[ids == NULL_BLOCK_ID] = -1
            keep_blocks = (
                max(keep_tokens // g.tokens_per_block, self.freed_blocks(g, computed_tokens)) - lo
            )
            if keep_blocks > 0:
                ids[:keep_blocks] = -1
            for key in g.block_id_keys:
                out[key] = ids
        return out

    def cached_groups(self) -> list[tuple[int, EngineGroup, int]]:
        """``(index, group, blocks per chunk)`` of each cached engine group."""
        return list(self._cached)

    def blocks_per_chunk_by_key(self) -> dict[str, int]:
        """Per cached server group, the block ids a chunk has in it."""
        return {key: bpc for _, g, bpc in self._cached for key in g.block_id_keys}

    def first_window_blocks(
        self, ids: dict[str, np.ndarray], first_chunk: int, n_chunks: int
    ) -> dict[int, int]:
        """Per sliding-window engine group (by index), the lowest block index in the
        request's table that a store of chunks ``first_chunk..+n_chunks`` with these
        ``ids`` (from :meth:`block_ids`) reads; groups it reads no block of are absent.

        Of each chunk a window group keeps only the blocks its window covers at the
        chunk's end (the last ``ceil(window / tokens_per_block)``), and ``-1`` ids are
        not read. The planner fences the store once the engine may free that block.
        """
        out: dict[int, int] = {}
        for gi, g in enumerate(self.groups):
            if not (g.cached and g.window_tokens):
                continue
            bpc = self.blocks_per_chunk(g)
            nwin = min(bpc, -(-g.window_tokens // g.tokens_per_block))
            read = ids[g.block_id_keys[0]].reshape(n_chunks, bpc)[:, bpc - nwin :]
            rows, cols = np.nonzero(read >= 0)
            if rows.size:
                out[gi] = int((first_chunk + rows[0]) * bpc + bpc - nwin + cols[0])
        return out
