"""The loads of one engine step: queued as the engine allocates, planned together.

Its own module for the same reason as :mod:`lmc_server.integration.stores`: which
blocks a load writes is where a mistake would put one prefix's KV into another
request's blocks. The planner (:mod:`lmc_server.integration.planning`) queues a load
when the engine allocated blocks for a hit (:meth:`LoadPlanner.queue`) and takes the
step's loads when it builds the step (:meth:`LoadPlanner.take`).

Invariants:

* a load reads only chunks its own lease covers (the lease of the lookup answer the hit
  came from) and writes only chunks ``0..n`` of its request's block tables as they were
  when the engine allocated them: :meth:`LoadPlanner.queue` reads the ids of the
  blocks the load writes then (from the engine's block objects or ids), so nothing
  the engine or the planner does to a table later moves the load;
* blocks the engine's own prefix cache holds (``keep_tokens``), vLLM's null block and
  blocks past a table's end are sent as ``-1`` (never written), exactly as
  :meth:`~lmc_server.integration.chunks.ChunkGeometry.block_ids` has them.

Why this shape: in the step that takes 256 hits every Python object the scheduler
thread touches costs (vLLM's block objects most of all, once they left the cache), so
each load's block ids are read once, as the engine allocates, while its blocks are
fresh, straight onto one list per group for the step (C-level, no list per load); the
step's loads are then one numpy array per group and a few columns
(:class:`~lmc_server.integration.plans.StepLoads`), no object per load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.integration.chunks import NULL_BLOCK_ID, ChunkGeometry
from lmc_server.integration.plans import LoadSpec, StepLoads
from lmc_server.integration.tracked import Tracked

__all__ = ["LoadPlanner"]


class LoadPlanner:
    """The loads queued since the last step."""

    def __init__(self, geometry: ChunkGeometry) -> None:
        self.geometry = geometry
        self._per_key = geometry.blocks_per_chunk_by_key()
        #: (index, group, blocks per chunk) of each cached engine group
        self._cached = geometry.cached_groups()
        self._columns()
        #: per cached group, the queued loads' block ids one after another
        self._ids = self._new_buffers()

    def _columns(self) -> None:
        """The queued loads, column by column (filled as the engine allocates, while
        each request's record is fresh, so that the step's plan is built from them
        without a loop over the loads)."""
        self._req_ids: list[str] = []
        self._digests: list[bytes] = []
        self._lease_ids: list[int] = []
        self._chunks: list[int] = []
        #: (index, tokens the engine holds) of each queued load that keeps some
        self._keeps: list[tuple[int, int]] = []

    def _new_buffers(self) -> list[list[int]]:
        bufs: list[list[int]] = [[] for _ in self._cached]
        #: (buffer, engine group index, blocks per chunk) per cached group
        self._where = [(b, gi, bpc) for b, (gi, _, bpc) in zip(bufs, self._cached, strict=True)]
        return bufs

    def queue(
        self,
        r: Tracked,
        n_chunks: int,
        keep_tokens: int,
        tables: Sequence[Sequence[Any]],
        ids_of: Callable[[Sequence[Any]], list[int]] | None = None,
    ) -> None:
        """Load chunks ``0..n_chunks`` of ``r`` into ``tables`` (per engine group its
        blocks; ``ids_of`` reads the ids of a part of a table, None: entries are ids)
        under its lease, except the blocks below ``keep_tokens``, with the next step.
        Its digests are taken now: those its lookup left (exactly the load's, as
        usual) or hashed once (:meth:`~.tracked.Tracked.digests_for`)."""
        if keep_tokens > 0:
            self._keeps.append((len(self._chunks), keep_tokens))
        d = r.digests
        if len(d) != n_chunks * DIGEST_BYTES:
            d = r.digests_for(self.geometry, n_chunks)
        self._req_ids.append(r.req_id)
        self._digests.append(d)
        self._lease_ids.append(r.lease_id)
        self._chunks.append(n_chunks)
        for buf, gi, bpc in self._where:
            want = n_chunks * bpc
            part = tables[gi][:want]
            buf += part if ids_of is None else ids_of(part)
            if len(part) < want:  # past the table's end: never written
                buf += [-1] * (want - len(part))

    def take(self) -> Sequence[LoadSpec]:
        """Every queued load, planned: the columns as queued, and the block ids one
        array per group for all of them (no loop over the loads but for those that
        keep blocks the engine holds)."""
        req_ids, digests, lease_ids, chunks, keeps = (
            self._req_ids,
            self._digests,
            self._lease_ids,
            self._chunks,
            self._keeps,
        )
        self._columns()
        bufs, self._ids = self._ids, self._new_buffers()
        if not req_ids:
            return []
        chunk_ends = list(accumulate(chunks))
        block_ids: dict[str, np.ndarray] = {}
        for buf, (_, eg, bpc) in zip(bufs, self._cached, strict=True):
            ids = np.array(buf, dtype=np.int32)
            ids[ids == NULL_BLOCK_ID] = -1
            for i, keep_tokens in keeps:
                at = (chunk_ends[i] - chunks[i]) * bpc
                keep_blocks = min(keep_tokens // eg.tokens_per_block, chunks[i] * bpc)
                ids[at : at + keep_blocks] = -1
            for key in eg.block_id_keys:
                block_ids[key] = ids
        return StepLoads(
            req_ids=req_ids,
            digests=digests,
            lease_ids=lease_ids,
            chunk_ends=chunk_ends,
            block_ids=block_ids,
            blocks_per_chunk=self._per_key,
        )
