"""The link's batched stores and retrieves: many engine requests' chunks per server request.

:meth:`BatchedTransfers.store_batch` and :meth:`~BatchedTransfers.retrieve_batch` carry
the chunks of many engine requests in one server request (chunk digests are independent
keys; a batched retrieve names where each prefix ends, so sliding windows are read at
every request's end), split only where the server's ``max_chunks_per_request`` or frame
limit requires, and retrieves also at :data:`LOAD_PART_CHUNKS`; one engine request's
chunks are never split. :class:`BatchedTransfers` is the base of
:class:`~lmc_server.integration.link.link.ServerLink`, which provides the connection
(``submit``, ``_send``, the registration and the server's limits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.client.core import BlockIds, ChunkResult, Registration
from lmc_server.protocol.messages import StoreEvents

T = TypeVar("T")

#: Most chunks of one retrieve request, where several requests' loads share it (one
#: request's load is never split). A server request is answered once, when all its
#: chunks are in: a step that starts 256 loads would otherwise report none finished
#: before the last; parts this size finish one after another, up to ``max_inflight``
#: copying at once (32 chunks of a Llama-3-8B-like cache: 1 GiB).
LOAD_PART_CHUNKS = 32

Item = tuple[bytes, BlockIds]


def join_events(parts: Sequence[StoreEvents | None]) -> StoreEvents | None:
    """One request's event fields from its items' (None unless every item has them,
    all with the same block size)."""
    if not parts or any(p is None for p in parts):
        return None
    ev = [p for p in parts if p is not None]
    if len({p.block_size for p in ev}) != 1:
        return None
    return StoreEvents(
        block_size=ev[0].block_size,
        token_ids=b"".join(p.token_ids for p in ev),
        block_hashes=b"".join(p.block_hashes for p in ev),
        parent_hashes=b"".join(p.parent_hashes for p in ev),
    )


"""One engine request's part of a batch: its chunk digests and block ids."""


class BatchedTransfers:
    """Store and retrieve batches over the link's connection (see the module docstring)."""

    max_chunks: int
    max_frame_bytes: int

    if TYPE_CHECKING:  # provided by ServerLink

        @property
        def reg(self) -> Registration: ...

        def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]: ...

        async def _send(self, op: str, *args: Any, **kwargs: Any) -> ChunkResult: ...

    def _split(
        self, items: Sequence[Item], with_events: bool = False, cap_chunks: int | None = None
    ) -> list[list[int]]:
        """Item indices per server request: in order, within the server's limits (a
        chunk's event fields are at most 12 bytes per token and 8 more) and at most
        ``cap_chunks`` chunks, except where one item alone has more (an item is never
        split)."""
        ids_per_chunk = sum(self.reg.blocks_per_chunk(g) for g in self.reg.groups)
        chunk_bytes = DIGEST_BYTES + 4 * ids_per_chunk
        if with_events:
            chunk_bytes += 12 * self.reg.chunk_size + 8
        max_chunks = max(
            1,
            min(
                self.max_chunks,
                (self.max_frame_bytes // 2) // chunk_bytes,
                cap_chunks or self.max_chunks,
            ),
        )
        out: list[list[int]] = []
        n = 0
        for i, (digests, _) in enumerate(items):
            k = len(digests) // DIGEST_BYTES
            if not out or n + k > max_chunks:
                out.append([])
                n = 0
            out[-1].append(i)
            n += k
        return out

    def _batch(
        self,
        op: str,
        items: Sequence[Item],
        ready: Callable[[], None] | None,
        events: Sequence[StoreEvents | None] = (),
    ) -> list[Future[ChunkResult]]:
        futs: list[Future[ChunkResult]] = [Future() for _ in items]
        for f in futs:
            f.set_running_or_notify_cancel()
        if not items:
            return futs

        async def one(part: list[int]) -> None:
            sizes = [len(items[i][0]) // DIGEST_BYTES for i in part]
            digests = b"".join(items[i][0] for i in part)
            keys = items[part[0]][1].keys()
            ids = {
                k: np.concatenate([np.asarray(items[i][1][k]).reshape(-1) for i in part])
                for k in keys
            }
            try:
                if op == "store":
                    res = await self._send(
                        op,
                        digests,
                        ids,
                        events=join_events([events[i] for i in part]) if events else None,
                    )
                else:
                    ends = np.cumsum(sizes).tolist()
                    res = await self._send(op, digests, ids, prefix_ends=ends)
            except BaseException as e:
                for i in part:
                    futs[i].set_exception(
                        e if isinstance(e, Exception) else ConnectionError("link closed")
                    )
                raise
            lo = 0
            for i, k in zip(part, sizes, strict=True):
                futs[i].set_result(
                    ChunkResult({og: st[lo : lo + k] for og, st in res.statuses.items()})
                )
                lo += k

        async def run() -> None:
            try:
                if ready is not None:
                    await asyncio.get_running_loop().run_in_executor(None, ready)
                cap = LOAD_PART_CHUNKS if op == "retrieve" else None
                await asyncio.gather(
                    *(one(p) for p in self._split(items, bool(events), cap)), return_exceptions=True
                )
            finally:
                for f in futs:
                    if not f.done():
                        f.set_exception(ConnectionError(f"{op} batch did not run"))

        self.submit(run())
        return futs

    def store_batch(
        self,
        items: Sequence[Item],
        ready: Callable[[], None] | None = None,
        events: Sequence[StoreEvents | None] = (),
    ) -> list[Future[ChunkResult]]:
        """Store every item's chunks, in as few server requests as the limits allow,
        once ``ready()`` (blocking: the engine's writes finished) returned; it runs on a
        worker thread, so neither the engine nor this link's loop waits. One future
        per item. ``events``: per item its KV-event fields (a server request carries
        them when every item in it has them)."""
        return self._batch("store", items, ready, events)

    def retrieve_batch(
        self, items: Sequence[Item], ready: Callable[[], None] | None = None
    ) -> list[Future[ChunkResult]]:
        """Retrieve every item's prefix (each item one prefix), batched, once
        ``ready()`` returned (as for stores: the engine's earlier writes to those
        blocks, such as zeroing them, finished); one future per item."""
        return self._batch("retrieve", items, ready)

    def store(
        self, digests: bytes, block_ids: BlockIds, ready: Callable[[], None] | None = None
    ) -> Future[ChunkResult]:
        return self.store_batch([(digests, block_ids)], ready)[0]

    def retrieve(
        self, digests: bytes, block_ids: BlockIds, ready: Callable[[], None] | None = None
    ) -> Future[ChunkResult]:
        return self.retrieve_batch([(digests, block_ids)], ready)[0]
