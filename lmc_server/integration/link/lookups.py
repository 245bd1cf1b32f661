"""The link's lookups: many engine requests' lookups per server request, hashed here.

:meth:`BatchedLookups.lookup_batch` sends the lookups of many engine requests as one
``lookup_batch`` request (each answered as a lookup, with a lease of its own), split only
where the server's ``max_chunks_per_request`` or frame limit requires, so the link's
thread encodes, sends and reads one message per scheduler step, not one per request.

:meth:`BatchedLookups.lookup_hashed` takes the digests as a function that the link's
thread calls: the scheduler thread hands a step's lookups over without hashing them
(hashing is the largest per-request cost of a step that takes many arrivals), and the
link's thread hashes and sends them in parts (:data:`LOOKUP_FIRST_PART_CHUNKS` chunks,
then twice as many each, up to :data:`LOOKUP_PART_CHUNKS`), each part sent before the
next is hashed, so the scheduler's first questions wait for a few chunks' hashing, not
the whole step's.

Invariants: every lookup handed over is answered exactly once (its part's answers, or
an error: a refused part, a ``digests`` that raised, a link closed first); a lookup of
no chunks is answered at once with no hit and no lease; one lookup is never split.
:class:`BatchedLookups` is a base of :class:`~lmc_server.integration.link.link.ServerLink`,
which provides the connection (``submit``, ``_request``, the server's limits).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.client.core import ServerError
from lmc_server.integration.plans import LookupAnswer, LookupBatch, PendingLookup

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Chunks of the first ``lookup_batch`` request of :meth:`ServerLink.lookup_hashed`, and
#: the most of any (one lookup is never split); each part after the first may hold
#: twice the chunks of the one before. The link's thread hashes a part and sends it
#: before it hashes the next, so a step's first answers wait for 16 chunks' hashing,
#: not the whole step's, while a step of many lookups still costs few messages (256
#: arrivals of 2 chunks: parts of 16, 32, 64, 128, 128, 128 and 16 chunks).
LOOKUP_FIRST_PART_CHUNKS = 16
LOOKUP_PART_CHUNKS = 128


class BatchedLookups:
    """Lookup batches over the link's connection (see the module docstring)."""

    max_chunks: int
    max_frame_bytes: int

    if TYPE_CHECKING:  # provided by ServerLink

        def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]: ...

        async def _request(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def lookup(self, digests: bytes) -> PendingLookup:
        return self.lookup_batch([digests])[0]

    def lookup_batch(self, prefixes: Sequence[bytes]) -> list[PendingLookup]:
        """One lookup per prefix, sent as ``lookup_batch`` requests (one unless the
        server's limits split them) from one hop onto the link's thread: neither the
        caller nor the link's thread pays a message per lookup. The answers are set
        part by part in one :class:`LookupBatch`. A prefix of no chunks is answered
        without asking (no hit, no lease)."""
        return list(self._lookups([len(d) // DIGEST_BYTES for d in prefixes], prefixes.__getitem__))

    def lookup_hashed(self, chunks: Sequence[int], digests: Callable[[int], bytes]) -> LookupBatch:
        """:meth:`lookup_batch` of ``digests(i)`` for each ``i`` of ``chunks``, hashed
        here on the link's thread (the scheduler thread only hands the request over),
        in parts of :data:`LOOKUP_FIRST_PART_CHUNKS` chunks, then twice as many each,
        up to :data:`LOOKUP_PART_CHUNKS`: each part is hashed and sent before the next
        is hashed, so the first lookups are answered after hashing a few chunks, not
        the whole step's."""
        return self._lookups(chunks, digests, LOOKUP_FIRST_PART_CHUNKS, LOOKUP_PART_CHUNKS)

    def _parts(
        self, chunks: Sequence[int], first_part_chunks: int, part_chunks: int
    ) -> tuple[list[int], list[list[int]]]:
        """The lookups of no chunks, and those of more in parts: in order, each part
        within the server's chunk and frame limits and, if given, ``part_chunks``, the
        first within ``first_part_chunks`` and each later one within twice the one
        before (a lookup alone may exceed these; it is never split)."""
        cap = max(1, min(self.max_chunks, (self.max_frame_bytes // 2) // DIGEST_BYTES))
        if part_chunks:
            cap = min(cap, part_chunks)
        limit = min(cap, first_part_chunks) if first_part_chunks else cap
        empty: list[int] = []
        parts: list[list[int]] = []
        n = -1  # < 0: no part yet
        for i, k in enumerate(chunks):
            if not k:
                empty.append(i)
                continue
            if n < 0 or n + k > limit:
                if n >= 0:
                    limit = min(cap, 2 * limit)
                parts.append([])
                n = 0
            parts[-1].append(i)
            n += k
        return empty, parts

    def _lookups(
        self,
        chunks: Sequence[int],
        digests: Callable[[int], bytes],
        first_part_chunks: int = 0,
        part_chunks: int = 0,
    ) -> LookupBatch:
        """The lookups, one :class:`LookupBatch` for all; split into parts (one
        ``lookup_batch`` request each, :meth:`_parts`), hashed and sent on the link's
        thread: the caller's thread pays one list and one hop, whatever their number."""
        batch = LookupBatch(len(chunks))
        if not chunks:
            return batch
        chunks = list(chunks)  # the caller may reuse its list once this returns

        async def one(part: list[int], prefixes: list[bytes]) -> None:
            try:
                results = await self._request("lookup_batch", prefixes, lease=True)
                if len(results) != len(prefixes):
                    raise ServerError(
                        "bad_request",
                        f"{len(results)} answers to a batch of {len(prefixes)} lookups",
                    )
            except Exception as e:
                batch.set(error=e, at=part)
                return
            batch.set(
                [
                    LookupAnswer(
                        r.hit_chunks,
                        r.lease_id,
                        r.lease_ttl_s,
                        l2_pending_chunks=r.l2_pending_chunks,
                    )
                    for r in results
                ],
                at=part,
            )

        async def run() -> None:
            sent: list[asyncio.Task[None]] = []
            try:
                empty, parts = self._parts(chunks, first_part_chunks, part_chunks)
                if empty:
                    batch.set([LookupAnswer(0, 0, 0.0)] * len(empty), at=empty)
                for part in parts:
                    try:
                        prefixes = [digests(i) for i in part]
                    except Exception as e:
                        logger.exception("hashing %d lookups failed", len(part))
                        batch.set(error=e, at=part)
                        continue
                    sent.append(asyncio.ensure_future(one(part, prefixes)))
                    await asyncio.sleep(0)  # the part goes out, replies are read
                await asyncio.gather(*sent)
            finally:  # cancelled with the link: those not answered above fail
                batch.set(error=ConnectionError("lookup did not run"))

        self.submit(run())
        return batch
