"""The scheduler's lookups: sent together, waited for within a per-step budget.

vLLM asks the connector for each waiting request in turn, on its scheduler thread.
Answering "ask again" costs the request a whole engine step; waiting costs every
request of the engine the time waited. :class:`StepLookups` takes the middle road:

* lookups of requests that arrived since the last step are queued and go out
  together, from one hop onto the link's thread (:meth:`StepLookups.flush`, at the
  step's first question or at its end), pipelined on the one connection; their chunk
  digests are hashed there too (:class:`LookupRound`), and their answers come back in
  one :class:`~lmc_server.integration.plans.LookupBatch`, so a step that takes many
  arrivals costs this thread a few references per request, not their hashing nor an
  object per answer;
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
from lmc_server.integration.plans import LookupAnswer, LookupBatch, LookupService


class LookupRound:
    """The lookups handed to the service together: per lookup (by index) the
    request's hash list, its chunk count and the digests it knew; once sent
    (:meth:`send`), the digests the service's thread hashed (:attr:`done`, which the
    planner adopts instead of hashing again for its loads and stores:
    :meth:`~lmc_server.integration.tracked.Tracked.adopt_digests`) and the answers
    (:attr:`answers`).

    :attr:`owners` (the requests, by index) is read on the scheduler thread only: to
    renumber before sending, and to settle the answers as they come (:attr:`settled`).

    Safe across the two threads without a lock, and without an object per request:
    the inputs are the engine's hash lists (which it only appends to: the hash of a
    full block never changes, the invariant the planner's digest cache rests on too;
    a list read is atomic under the GIL), the chunk counts and the digests known then
    (immutable ``bytes``), none written once the round is sent; a reader sees a slot
    of :attr:`done` either empty (``None``: not hashed yet, or hashing failed) or
    holding the finished ``bytes``. A few lists per round: every object allocated
    brings the cyclic collector's next pass nearer, and that pass runs in whichever
    hook allocates.
    """

    __slots__ = (
        "_cancelled",
        "_geometry",
        "answers",
        "chunks",
        "done",
        "hashes",
        "known",
        "owners",
        "settled",
    )

    def __init__(self, geometry: ChunkGeometry) -> None:
        self._geometry = geometry
        self.owners: list[Queued] = []
        self.hashes: list[Sequence[bytes]] = []
        self.chunks: list[int] = []
        self.known: list[bytes] = []
        self.done: list[bytes | None] = []
        self._cancelled = 0
        #: the answers, once sent (None: still queued)
        self.answers: LookupBatch | None = None
        #: how many of :attr:`answers`' ``order`` the planner has settled
        #: (:meth:`~lmc_server.integration.planning.SchedulerPlanner.matched_tokens`)
        self.settled = 0

    def add(self, r: Queued) -> None:
        """Queue ``r``'s lookup of ``r.lookup_chunks`` chunks (``r.lookup`` and
        ``r.lookup_index`` point here)."""
        r.lookup, r.lookup_index = self, len(self.chunks)
        self.owners.append(r)
        self.hashes.append(r.block_hashes)
        self.chunks.append(r.lookup_chunks)
        self.known.append(r.digests)

    def cancel(self, i: int) -> None:
        """Lookup ``i`` is not wanted any more (its request no longer points here);
        before the round is sent only: it is not sent."""
        assert self.answers is None, "a lookup sent cannot be cancelled"
        if self.chunks[i]:
            self.chunks[i] = 0
            self._cancelled += 1

    def send(self, service: LookupService) -> None:
        """Hand the lookups not cancelled to ``service`` (a cancelled one renumbers
        those after it: rare, an arrival that ended before its step's first question)."""
        if self._cancelled:
            keep = [i for i, k in enumerate(self.chunks) if k]
            for name in ("owners", "hashes", "chunks", "known"):
                old = getattr(self, name)
                setattr(self, name, [old[i] for i in keep])
            for j, r in enumerate(self.owners):
                r.lookup_index = j
            self._cancelled = 0
        # the owners stay: the planner settles answers by index (owner i's lookup is
        # still this round's lookup i only while ``owners[i].lookup`` is this round)
        if not self.chunks:
            return
        self.done = [None] * len(self.chunks)
        self.answers = service.lookup_hashed(self.chunks, self.digests)

    def digests(self, i: int) -> bytes:
        """Lookup ``i``'s digests (hashed once: a second call returns the first's)."""
        out = self.done[i]
        if out is None:
            out = self._geometry.digests(self.hashes[i], self.chunks[i], self.known[i])
            self.done[i] = out
        return out


class Queued(Protocol):
    """What :class:`StepLookups` needs of a request whose lookup it queues."""

    block_hashes: Sequence[bytes]
    lookup_chunks: int
    #: the request's digests known so far (a prefix)
    digests: bytes
    #: the round its lookup is queued in or sent with, and which of its lookups
    lookup: LookupRound | None
    lookup_index: int

    def adopt_digests(self) -> None: ...


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
        #: the lookups to go out with the next :meth:`flush` (None: none): :meth:`queue`
        #: adds one, the planner's arrivals add many to :meth:`next_round`, and the
        #: planner reads it to skip a call when it is None
        self.round: LookupRound | None = None

    def next_round(self) -> LookupRound:
        """The round the next :meth:`flush` sends (made if there is none)."""
        if self.round is None:
            self.round = LookupRound(self.geometry)
        return self.round

    def queue(self, r: Queued) -> None:
        """Send ``r``'s lookup (of ``r.lookup_chunks`` chunks) with the next :meth:`flush`."""
        self.next_round().add(r)

    def flush(self) -> None:
        """Send the queued lookups in one hand-over to the service, which hashes them
        on its own thread (those cancelled since ask for nothing)."""
        rnd, self.round = self.round, None
        if rnd is not None:
            rnd.send(self.service)

    def send(self, r: Queued) -> None:
        """``r``'s lookup now (a request looked up again: preempted, lease refresh)."""
        self.queue(r)
        self.flush()

    def wait(self, answers: LookupBatch, i: int) -> None:
        """Wait for lookup ``i`` of ``answers`` while this step's budget lasts."""
        if self._left_s <= 0 or answers.get(i) is not None:
            return
        t0 = time.perf_counter()
        answers.wait(i, self._left_s)
        waited_s = time.perf_counter() - t0
        self._left_s = max(0.0, self._left_s - waited_s)
        self.waited_s += waited_s

    def new_step(self) -> None:
        """The step ended: send what is still queued, renew the budget."""
        self.flush()
        self._left_s = self.wait_s

    def drop(self, r: Queued) -> None:
        """Forget ``r``'s queued or unanswered lookup: one queued is not sent, one sent
        has its lease released when its answer comes (the digests hashed for it are
        kept, :meth:`Queued.adopt_digests`)."""
        rnd = r.lookup
        if rnd is None:
            return
        if rnd.answers is None:
            rnd.cancel(r.lookup_index)
        else:
            r.adopt_digests()
            self.release_when_answered(rnd.answers, r.lookup_index)
        r.lookup = None

    def release_when_answered(self, answers: LookupBatch, i: int) -> None:
        """Release the lease of lookup ``i``'s answer when it comes (its request is
        gone)."""

        def release(done: Any) -> None:
            if done.exception() is None and done.result().lease_id:
                self.service.release(done.result().lease_id)

        answers.add_done_callback(i, release)


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
