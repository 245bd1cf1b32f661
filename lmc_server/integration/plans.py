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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, overload

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
    """The answers of many lookups, each set once by the thread that read it
    (:meth:`set`, a part of them at a time); :meth:`answer` is lookup ``i``'s
    :class:`PendingLookup`, :meth:`get` its answer (or error) without a call to wait.

    Why not one ``Future`` per lookup: a step that takes 256 arrivals would build and
    read 256 of them on the scheduler thread (a lock and a condition each) and resolve
    256 on the link's thread; one batch for the step's lookups costs the scheduler
    thread one list per step, and a reader finds an answer by index, without a lock.
    Invariants: a lookup's answer is set exactly once (its answer, or an error: the
    first :meth:`set` that covers it counts; an error for the whole batch covers every
    lookup not answered yet); a callback added before runs once on the setting thread,
    one added after runs at once; :attr:`order` lists each lookup whose slot was set,
    once, in the order set, each index appended only after its slot was written (a
    reader on another thread that sees an index sees its slot).
    """

    __slots__ = ("_callbacks", "_cond", "_error", "order", "slots")

    def __init__(self, n: int = 0) -> None:
        #: per lookup its answer or error once set (a slot is written once, last, so a
        #: reader that sees it sees all of it); ``None`` until then
        self.slots: list[LookupAnswer | BaseException | None] = [None] * n
        #: the lookups whose slots are set, in the order set (a batch-wide error sets
        #: none: it is read through :meth:`get`)
        self.order: list[int] = []
        self._error: BaseException | None = None
        self._cond = threading.Condition(threading.Lock())
        self._callbacks: list[tuple[Callable[[Any], object], _BatchAnswer]] = []

    def answer(self, i: int) -> PendingLookup:
        return _BatchAnswer(self, i)

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> PendingLookup:
        return _BatchAnswer(self, i)

    def __iter__(self) -> Iterator[PendingLookup]:
        return (_BatchAnswer(self, i) for i in range(len(self.slots)))

    def get(self, i: int) -> LookupAnswer | BaseException | None:
        """Lookup ``i``'s answer or error, ``None`` while it is not in (no lock)."""
        slots = self.slots
        got = slots[i] if i < len(slots) else None
        return self._error if got is None else got

    def wait(self, i: int, timeout: float | None) -> bool:
        """Wait at most ``timeout`` for lookup ``i``; True: it is in."""
        if self.get(i) is not None:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self.get(i) is not None, timeout)

    def set(
        self,
        answers: Sequence[LookupAnswer] = (),
        error: BaseException | None = None,
        at: Sequence[int] | None = None,
    ) -> None:
        """Answer lookups ``at`` (default ``0..len(answers)``) with ``answers`` in
        order, or every one of ``at`` with ``error``; ``error`` without ``at``: every
        lookup of the batch not answered yet. A lookup answered before keeps its answer."""
        with self._cond:
            slots = self.slots
            if at is None and error is not None:
                if self._error is None:
                    self._error = error
            else:
                idx = range(len(answers)) if at is None else at
                values: Sequence[LookupAnswer | BaseException] = (
                    answers if error is None else [error] * len(idx)
                )
                order = self.order
                for i, value in zip(idx, values, strict=True):
                    if i >= len(slots):
                        slots.extend([None] * (i + 1 - len(slots)))
                    if slots[i] is None:
                        slots[i] = value
                        order.append(i)
            self._cond.notify_all()
            ready = [cb for cb in self._callbacks if self.get(cb[1].i) is not None]
            if ready:
                self._callbacks = [cb for cb in self._callbacks if cb not in ready]
        for fn, pending in ready:
            fn(pending)

    def add_done_callback(self, i: int, fn: Callable[[Any], object]) -> None:
        """Call ``fn(self.answer(i))`` once lookup ``i`` is answered (now if it is)."""
        self._add_callback(fn, _BatchAnswer(self, i))

    def _add_callback(self, fn: Callable[[Any], object], pending: _BatchAnswer) -> None:
        with self._cond:
            if self.get(pending.i) is None:
                self._callbacks.append((fn, pending))
                return
        fn(pending)


class _BatchAnswer:
    """Lookup ``i`` of a :class:`LookupBatch`."""

    __slots__ = ("batch", "i")

    def __init__(self, batch: LookupBatch, i: int) -> None:
        self.batch, self.i = batch, i

    def done(self) -> bool:
        return self.batch.get(self.i) is not None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.batch.wait(self.i, timeout):
            raise TimeoutError("lookup not answered yet")
        got = self.batch.get(self.i)
        return got if isinstance(got, BaseException) else None

    def result(self, timeout: float | None = None) -> LookupAnswer:
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        got = self.batch.get(self.i)
        assert isinstance(got, LookupAnswer)
        return got

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        self.batch._add_callback(fn, self)


class LookupService(Protocol):
    """The scheduler's link to the server (a lookup-only registration)."""

    def lookup_hashed(self, chunks: Sequence[int], digests: Callable[[int], bytes]) -> LookupBatch:
        """Lookup ``i`` of ``len(chunks)`` asks for the ``chunks[i]`` digests that
        ``digests(i)`` returns. The service calls ``digests`` on its own thread, each
        ``i`` at most once and before lookup ``i``'s answer is set, so the caller's
        thread never hashes; a ``digests`` that raises fails its lookups. A lookup of
        no chunks is answered without asking (no hit, no lease), and ``digests`` need
        not be called for it."""
        ...

    def release(self, lease_id: int) -> None: ...


class LoadSpec(NamedTuple):
    """Retrieve chunks ``0..n`` of a request into its blocks (``-1``: leave alone).

    A named tuple, not a frozen dataclass: as immutable, and built in a fifth of the
    time (a worker builds one per load of the step from :class:`StepLoads`)."""

    req_id: str
    digests: bytes
    block_ids: dict[str, np.ndarray]
    lease_id: int

    @property
    def n_chunks(self) -> int:
        return len(self.digests) // DIGEST_BYTES


@dataclass(frozen=True, slots=True, eq=False)
class StepLoads(Sequence[LoadSpec]):
    """The loads of one engine step, column by column: load ``i`` is ``self[i]``, a
    :class:`LoadSpec` whose block ids are views of ``block_ids`` (each key's array
    holds every load's ids in order, ``blocks_per_chunk[key]`` per chunk, load ``i``'s
    from ``chunk_ends[i - 1]`` chunks on).

    Why columns: the step that takes 256 hits plans them on the scheduler thread, and
    a dictionary, a view and a named tuple per load cost it more than all their block
    ids turned into arrays at once; the columns are built once per step (one array per
    group, :meth:`~lmc_server.integration.loads.LoadPlanner.take`), and a load's own
    :class:`LoadSpec` only where a worker asks for it. Invariant: the columns are never
    written once built (a load's views alias the step's arrays)."""

    req_ids: list[str]
    digests: list[bytes]
    lease_ids: list[int]
    #: cumulative chunk counts: load ``i`` covers chunks ``chunk_ends[i-1]..chunk_ends[i]``
    chunk_ends: list[int]
    block_ids: dict[str, np.ndarray]
    blocks_per_chunk: dict[str, int]

    def __len__(self) -> int:
        return len(self.req_ids)

    @overload
    def __getitem__(self, i: int) -> LoadSpec: ...

    @overload
    def __getitem__(self, i: slice) -> list[LoadSpec]: ...

    def __getitem__(self, i: int | slice) -> LoadSpec | list[LoadSpec]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        lo = self.chunk_ends[i - 1] if i else 0
        hi = self.chunk_ends[i]
        per = self.blocks_per_chunk
        ids = {k: a[lo * per[k] : hi * per[k]] for k, a in self.block_ids.items()}
        return LoadSpec(self.req_ids[i], self.digests[i], ids, self.lease_ids[i])


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

    #: the step's loads (the planner's: a :class:`StepLoads`)
    loads: Sequence[LoadSpec] = field(default_factory=list)
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
