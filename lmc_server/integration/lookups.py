"""The scheduler's lookups: sent together, waited for within a per-step budget.

vLLM asks the connector for each waiting request in turn, on its scheduler thread.
Answering "ask again" costs the request a whole engine step; waiting costs every
request of the engine the time waited. :class:`StepLookups` takes the middle road:

* lookups of requests that arrived since the last step are queued and go out
  together, from one hop onto the link's thread (:meth:`StepLookups.flush`, at the
  step's first question or at its end), pipelined on the one connection; their chunk
  digests are hashed there too (:class:`HashedDigests`), so a step that takes many
  arrivals costs this thread a few references per request, not their hashing;
* a question waits for its own answer only while the step's budget (``wait_s``) lasts;
  the budget is for all questions of a step together and is renewed each step
  (:meth:`StepLookups.new_step`). So a server that answers within the bound costs no
  step, and a slow one costs the scheduler thread at most ``wait_s`` per step, however
  many requests wait;
* a lookup whose request is gone has its lease released as soon as the answer comes,
  on the link's thread: an idle engine takes no further step that could do it.

An answer whose hit stops short while the server brings the continuation in from its
L2 tier may be set aside for a bounded time (:class:`L2Waits`), so that a request waits
a little for a longer hit rather than loading the short one.

Pure bookkeeping over :class:`~lmc_server.integration.plans.LookupService` answers;
the planner (:mod:`lmc_server.integration.planning`) decides what to look up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.plans import LookupAnswer, LookupService, PendingLookup


class HashedDigests:
    """The digests of one batch of lookups, computed by the lookup service's thread.

    :meth:`digests` is what the service calls (``LookupService.lookup_hashed``); each
    request's digests are kept in :attr:`done` so that the planner adopts them
    (:meth:`~lmc_server.integration.tracked.Tracked.adopt_digests`) instead of hashing
    again for its loads and stores.

    Safe across the two threads without a lock, and without copying anything per
    request on the scheduler thread: the inputs are the engine's hash lists (which
    it only appends to: the hash of a full block never changes, the invariant the
    planner's digest cache rests on too; a list read is atomic under the GIL), the
    chunk counts and the digests known then (immutable ``bytes``); a reader sees a
    slot of :attr:`done` either empty (``None``: not hashed yet, or hashing failed)
    or holding the finished ``bytes``. Three lists per batch, no object per request:
    every object allocated brings the cyclic collector's next pass nearer, and that
    pass runs in whichever hook allocates.
    """

    __slots__ = ("_chunks", "_geometry", "_hashes", "_known", "done")

    def __init__(
        self,
        geometry: ChunkGeometry,
        hashes: list[Sequence[bytes]],
        chunks: list[int],
        known: list[bytes],
    ) -> None:
        self._geometry = geometry
        self._hashes, self._chunks, self._known = hashes, chunks, known
        self.done: list[bytes | None] = [None] * len(chunks)

    def digests(self, i: int) -> bytes:
        """Lookup ``i``'s digests (hashed once: a second call returns the first's)."""
        out = self.done[i]
        if out is None:
            out = self._geometry.digests(self._hashes[i], self._chunks[i], self._known[i])
            self.done[i] = out
        return out


class Queued(Protocol):
    """What :class:`StepLookups` needs of a request whose lookup is queued."""

    queued: bool
    ended: bool
    lookup: PendingLookup | None
    block_hashes: Sequence[bytes]
    lookup_chunks: int
    #: the request's digests known so far (a prefix)
    digests: bytes
    #: where its lookup's digests are hashed, and which of them (set when the lookup
    #: goes out; two fields, not a tuple: no object per request)
    hashed: HashedDigests | None
    hashed_index: int


class StepLookups:
    """Queued and in-flight lookups of one scheduler, and the step's wait budget.

    ``waited_s`` sums the time waited for answers.
    """

    def __init__(self, service: LookupService, wait_s: float, geometry: ChunkGeometry) -> None:
        if not 0.0 <= wait_s < float("inf"):
            raise ValueError(f"lookup_wait_s {wait_s} must be finite and >= 0")
        self.service = service
        self.wait_s = wait_s
        self.waited_s = 0.0
        self.geometry = geometry
        self._left_s = wait_s
        #: lookups queued to go out with the next :meth:`flush`: :meth:`queue` adds
        #: one, the planner's arrivals add many the same way (``queued`` set, then
        #: appended), and the planner reads it to skip a call when it is empty
        self.pending: list[Queued] = []

    def queue(self, r: Queued) -> None:
        """Send ``r``'s lookup (of ``r.lookup_chunks`` chunks) with the next :meth:`flush`."""
        r.queued = True
        self.pending.append(r)

    def flush(self) -> None:
        """Send every queued lookup whose request is still queued and alive, in one
        hand-over to the service, which hashes them on its own thread."""
        if not self.pending:
            return
        reqs = [r for r in self.pending if r.queued and not r.ended]
        self.pending = []
        if not reqs:
            return
        chunks = [r.lookup_chunks for r in reqs]
        hashed = HashedDigests(
            self.geometry, [r.block_hashes for r in reqs], chunks, [r.digests for r in reqs]
        )
        futs = self.service.lookup_hashed(chunks, hashed.digests)
        for i, (r, fut) in enumerate(zip(reqs, futs, strict=True)):
            r.lookup, r.queued, r.hashed, r.hashed_index = fut, False, hashed, i

    def send(self, r: Queued) -> None:
        """``r``'s lookup now (a request looked up again: preempted, lease refresh)."""
        self.queue(r)
        self.flush()

    def wait(self, fut: PendingLookup) -> None:
        """Wait for ``fut`` while this step's budget lasts."""
        if fut.done() or self._left_s <= 0:
            return
        t0 = time.perf_counter()
        try:
            fut.exception(self._left_s)
        except TimeoutError:
            pass
        waited_s = time.perf_counter() - t0
        self._left_s = max(0.0, self._left_s - waited_s)
        self.waited_s += waited_s

    def new_step(self) -> None:
        """The step ended: send what is still queued, renew the budget."""
        self.flush()
        self._left_s = self.wait_s

    def release_when_answered(self, fut: PendingLookup) -> None:
        """Release the lease of ``fut``'s answer when it comes (its request is gone)."""

        def release(done: Any) -> None:
            if done.exception() is None and done.result().lease_id:
                self.service.release(done.result().lease_id)

        fut.add_done_callback(release)


class WaitsForL2(Protocol):
    """What :class:`L2Waits` needs of a request: when its wait began."""

    l2_wait_from: float | None


class L2Waits:
    """Whether an answer is set aside while the server brings chunks in from its L2 tier.

    ``wait_s``: how long a request may wait (answering "ask again") from the first
    answer that reported L2 chunks pending; 0: never wait. ``waits`` counts answers set
    aside, ``expired`` the waits that ended at the bound with chunks still pending.
    """

    def __init__(self, chunk_size: int, wait_s: float) -> None:
        if not 0.0 <= wait_s < float("inf"):
            raise ValueError(f"l2_wait_s {wait_s} must be finite and >= 0")
        self.chunk_size = chunk_size
        self.wait_s = wait_s
        self.waits = 0
        self.expired = 0

    def set_aside(
        self,
        r: WaitsForL2,
        answer: LookupAnswer,
        n_chunks: int,
        num_computed_tokens: int,
        now: float,
    ) -> bool:
        """True: set ``answer`` aside and ask again later, since the server is bringing
        chunks in from L2 that would load more than the answer's hit does now."""
        if answer.l2_pending_chunks <= 0 or answer.hit_chunks >= n_chunks or self.wait_s <= 0:
            return False
        coming = min(n_chunks, answer.hit_chunks + answer.l2_pending_chunks)
        if coming * self.chunk_size <= num_computed_tokens:
            return False  # the engine's own prefix cache already holds all of it
        if r.l2_wait_from is None:
            r.l2_wait_from = now
        elif now - r.l2_wait_from >= self.wait_s:
            self.expired += 1
            return False
        self.waits += 1
        return True
