"""What scheduler-side planning exchanges with the rest of the connector.

In: :class:`ScheduledRequest` (what the adapter reads from the engine each step) and
:class:`LookupAnswer` (the server's answer, through a :class:`LookupService`, as a
:class:`PendingLookup` until it comes). Out:
:class:`StepPlan`, the loads and stores the workers run in one engine step
(:mod:`lmc_server.integration.worker`). Plain values, so the planner, the link and the
workers depend on these and not on each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.protocol.messages import StoreEvents


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    hit_chunks: int
    lease_id: int
    lease_ttl_s: float
    #: chunks after the hit the server is fetching from its L2 tier (0 without one)
    l2_pending_chunks: int = 0


class PendingLookup(Protocol):
    """A lookup's answer to come: the part of :class:`concurrent.futures.Future` the
    planner uses (a ``Future[LookupAnswer]`` is one). ``exception(timeout)`` waits at
    most ``timeout`` and raises ``TimeoutError`` if the answer has not come."""

    def done(self) -> bool: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...

    def result(self, timeout: float | None = None) -> LookupAnswer: ...

    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...


class LookupBatch:
    """The answers of one batch of lookups, set together by the thread that read them
    (:meth:`set`); :meth:`answer` is lookup ``i``'s :class:`PendingLookup`.

    Why not one ``Future`` per lookup: a step that takes 256 arrivals would build and
    read 256 of them on the scheduler thread (a lock and a condition each) and resolve
    256 on the link's thread; one event per batch costs the same for 1 or 256.
    Invariants: the batch is set exactly once (answers or one error for all); a
    callback added before runs once on the setting thread, one added after runs at once.
    """

    __slots__ = ("_answers", "_callbacks", "_done", "_error", "_event", "_lock")

    def __init__(self) -> None:
        #: answers or error in place (set last, so a reader that sees it sees them):
        #: what the scheduler thread reads, without a call, for every question
        self._done = False
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._answers: Sequence[LookupAnswer] = ()
        self._error: BaseException | None = None
        self._callbacks: list[tuple[Callable[[Any], object], _BatchAnswer]] = []

    def answer(self, i: int) -> PendingLookup:
        return _BatchAnswer(self, i)

    def set(self, answers: Sequence[LookupAnswer] = (), error: BaseException | None = None) -> None:
        """Every answer (in order), or ``error`` for all of them; only the first call
        counts."""
        with self._lock:
            if self._done:
                return
            self._answers, self._error = answers, error
            self._done = True
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn, pending in callbacks:
            fn(pending)


class _BatchAnswer:
    """Lookup ``i`` of a :class:`LookupBatch`."""

    __slots__ = ("batch", "i")

    def __init__(self, batch: LookupBatch, i: int) -> None:
        self.batch, self.i = batch, i

    def done(self) -> bool:
        return self.batch._done

    def exception(self, timeout: float | None = None) -> BaseException | None:
        batch = self.batch
        if not batch._done and not batch._event.wait(timeout):  # no lock when done
            raise TimeoutError("lookup not answered yet")
        return batch._error

    def result(self, timeout: float | None = None) -> LookupAnswer:
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self.batch._answers[self.i]

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        with self.batch._lock:
            if not self.batch._done:
                self.batch._callbacks.append((fn, self))
                return
        fn(self)


class LookupService(Protocol):
    """The scheduler's link to the server (a lookup-only registration)."""

    def lookup_hashed(
        self, chunks: Sequence[int], digests: Callable[[int], bytes]
    ) -> Sequence[PendingLookup]:
        """Lookup ``i`` of ``len(chunks)`` asks for the ``chunks[i]`` digests that
        ``digests(i)`` returns. The service calls ``digests`` on its own thread, each
        ``i`` at most once and before lookup ``i``'s answer is set, so the caller's
        thread never hashes; a ``digests`` that raises fails its lookups."""
        ...

    def release(self, lease_id: int) -> None: ...


class LoadSpec(NamedTuple):
    """Retrieve chunks ``0..n`` of a request into its blocks (``-1``: leave alone).

    A named tuple, not a frozen dataclass: as immutable, and built in a fifth of the
    time (a step that takes 256 hits builds 256 on the scheduler thread)."""

    req_id: str
    digests: bytes
    block_ids: dict[str, np.ndarray]
    lease_id: int

    @property
    def n_chunks(self) -> int:
        return len(self.digests) // DIGEST_BYTES


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Store chunks ``first_chunk..`` of a request from its blocks (``-1``: not read).

    ``store_id`` names the store for fences (:attr:`StepPlan.fence_store_ids`).
    ``events``: what the server's KV-event subscribers see of these chunks (with
    ``lmcache.mp.kv_events``), else None.
    """

    req_id: str
    first_chunk: int
    digests: bytes
    block_ids: dict[str, np.ndarray]
    store_id: int = 0
    events: StoreEvents | None = None

    @property
    def n_chunks(self) -> int:
        return len(self.digests) // DIGEST_BYTES


@dataclass(slots=True)
class StepPlan:
    """What the workers do in one engine step.

    ``fence_store_ids``: stores (of earlier steps) that read blocks this step's
    scheduling may have freed; the workers wait for them before this step's loads
    and forward pass write any block.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    fence_store_ids: set[int] = field(default_factory=set)
    #: tokens the step computes (0: no forward pass, the engine is otherwise idle)
    scheduled_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a scheduler step, as the adapter reads it from the engine.

    ``new_block_ids`` appends to the request's block tables, or replaces them when
    ``resumed`` (a preempted request that starts over) or when it is a new request.
    """

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: Sequence[Sequence[int]] | None
    replace_blocks: bool = False
