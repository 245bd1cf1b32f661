"""The scheduler's lookups: sent together, waited for within a per-step budget.

vLLM asks the connector for each waiting request in turn, on its scheduler thread.
Answering "ask again" costs the request a whole engine step; waiting costs every
request of the engine the time waited. :class:`StepLookups` takes the middle road:

* lookups of requests that arrived since the last step are queued and go out
  together, from one hop onto the link's thread (:meth:`StepLookups.flush`, at the
  step's first question or at its end), pipelined on the one connection;
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
from collections.abc import Callable
from typing import Any, Protocol

from lmc_server.integration.plans import LookupAnswer, LookupService, PendingLookup


class Queued(Protocol):
    """What :class:`StepLookups` needs of a request whose lookup is queued."""

    queued: bool
    ended: bool
    lookup: PendingLookup | None


class StepLookups:
    """Queued and in-flight lookups of one scheduler, and the step's wait budget.

    ``waited_s`` sums the time waited for answers.
    """

    def __init__(self, service: LookupService, wait_s: float) -> None:
        if not 0.0 <= wait_s < float("inf"):
            raise ValueError(f"lookup_wait_s {wait_s} must be finite and >= 0")
        self.service = service
        self.wait_s = wait_s
        self.waited_s = 0.0
        self._left_s = wait_s
        self._queued: list[Queued] = []

    def queue(self, r: Queued) -> None:
        """Send ``r``'s lookup with the next :meth:`flush`."""
        r.queued = True
        self._queued.append(r)

    def flush(self, digests: Callable[[Queued], bytes]) -> None:
        """Send every queued lookup whose request is still queued and alive, in one
        batch; ``digests(r)`` gives what to look up."""
        if not self._queued:
            return
        reqs = [r for r in self._queued if r.queued and not r.ended]
        self._queued = []
        futs = self.service.lookup_batch([digests(r) for r in reqs])
        for r, fut in zip(reqs, futs, strict=True):
            r.lookup, r.queued = fut, False

    def send(self, digests: bytes) -> PendingLookup:
        """One lookup now (a request looked up again: preempted, lease refresh)."""
        return self.service.lookup_batch([digests])[0]

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

    def new_step(self, digests: Callable[[Queued], bytes]) -> None:
        """The step ended: send what is still queued, renew the budget."""
        self.flush(digests)
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
