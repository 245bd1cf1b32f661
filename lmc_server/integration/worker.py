"""Worker-side connector runtime: issue loads and stores, report each outcome once.

:class:`TransferTracker` is the bookkeeping (pure): which requests have loads or held
stores in flight, and what to report to the engine. :class:`WorkerTransfers` drives a
:class:`~lmc_server.integration.link.link.ServerLink` from a step's
:class:`~lmc_server.integration.plans.StepPlan`.

Reporting contract (what vLLM's KV output aggregator relies on):

* ``finished_recving``: every load is reported exactly once, when its retrieve
  finished, successfully or not. A failed load is also reported as failed: by block ids
  where vLLM's recovery from them is sound (:func:`failures_by_block_ids`), otherwise
  in ``failed_recving`` (the whole request). A failed load is never reported as
  success.
* ``finished_sending``: a request with a store planned is reported exactly once, after
  the engine said it finished and every store this rank issued for it completed. Ranks
  that do not store (replicated KV: only one rank stores) report it as soon as it
  finished, so that every rank reports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np

from lmc_server.client.core import ChunkResult
from lmc_server.integration.chunks import EngineGroup
from lmc_server.integration.link.link import ServerLink
from lmc_server.integration.plans import LoadSpec, StepPlan, StoreSpec

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Load:
    spec: LoadSpec
    future: Future[ChunkResult]


@dataclass(slots=True)
class Report:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


def failures_by_block_ids(groups: Sequence[EngineGroup]) -> bool:
    """Whether a failed load may be reported by block ids rather than as a failed request.

    vLLM 0.33 resumes a request whose load reported invalid blocks at the first of them
    (``_update_requests_with_invalid_blocks``), keeping its block table; attention there
    reads every earlier position (full attention) or the window before it. Every
    earlier block of a full-attention table is one vLLM held or one a chunk that did
    not fail wrote, so that is sound for one full-attention group. A sliding-window
    group holds only the window at the hit's end (earlier entries are the null block,
    which cannot be named), so the window before any failed block may never have been
    written: there, and with several groups (vLLM refuses block ids then), the request
    is reported failed (``failed_recving``); vLLM then frees its blocks and schedules
    it afresh, from its own prefix cache, never from a window it does not hold.
    """
    cached = [g for g in groups if g.cached]
    return len(groups) == 1 and len(cached) == 1 and not cached[0].window_tokens


class TransferTracker:
    """In-flight transfers per request and the exactly-once reports derived from them.

    ``by_block_ids``: report failed loads by block ids (:func:`failures_by_block_ids`);
    otherwise by request (``failed_recving``).
    """

    def __init__(self, by_block_ids: bool) -> None:
        self.by_block_ids = by_block_ids
        self._loads: dict[str, _Load] = {}
        self._stores: dict[str, list[Future[ChunkResult]]] = {}
        self._finished: set[str] = set()
        self.failed_store_chunks = 0

    def load_started(self, spec: LoadSpec, future: Future[ChunkResult]) -> None:
        assert spec.req_id not in self._loads, f"two loads in flight for {spec.req_id}"
        self._loads[spec.req_id] = _Load(spec, future)

    def store_planned(self, req_id: str, future: Future[ChunkResult] | None) -> None:
        """A store spec for ``req_id`` (``None``: this rank does not store it)."""
        futs = self._stores.setdefault(req_id, [])
        if future is not None:
            futs.append(future)

    def store_futures(self, req_ids: Iterable[str] | None = None) -> list[Future[ChunkResult]]:
        ids = self._stores.keys() if req_ids is None else req_ids
        return [f for r in ids for f in self._stores.get(r, ())]

    def load_futures(self) -> list[Future[ChunkResult]]:
        return [load.future for load in self._loads.values()]

    @property
    def busy(self) -> bool:
        return bool(self._loads) or any(self._stores.values())

    def _failed_blocks(self, spec: LoadSpec, result: ChunkResult | None) -> set[int]:
        n = spec.n_chunks
        bad = np.ones(n, dtype=bool) if result is None else ~result.ok
        out: set[int] = set()
        for ids in spec.block_ids.values():
            per_chunk = ids.reshape(n, -1)
            out.update(int(b) for b in per_chunk[bad].reshape(-1) if b >= 0)
        return out

    def poll(self, finished_req_ids: Iterable[str]) -> Report:
        """What completed since the last poll; ``finished_req_ids`` ended this step."""
        self._finished.update(finished_req_ids)
        rep = Report()
        for req_id, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[req_id]
            exc = load.future.exception()
            result = None if exc is not None else load.future.result()
            if exc is not None:
                logger.warning("load for request %s failed: %s", req_id, exc)
            failed = self._failed_blocks(load.spec, result)
            if failed or (result is None):
                logger.warning("load for request %s: %d blocks failed", req_id, len(failed))
                if self.by_block_ids:
                    rep.invalid_block_ids |= failed
                else:
                    rep.failed_recving.add(req_id)
            rep.finished_recving.add(req_id)
        for req_id, futs in list(self._stores.items()):
            pending = []
            for f in futs:
                if not f.done():
                    pending.append(f)
                    continue
                exc = f.exception()
                if exc is not None:
                    logger.warning("store for request %s failed: %s", req_id, exc)
                else:
                    self.failed_store_chunks += len(f.result().failed_chunks)
            self._stores[req_id] = pending
            if not pending and req_id in self._finished:
                del self._stores[req_id]
                rep.finished_sending.add(req_id)
        self._finished &= set(self._stores)
        return rep


class WorkerTransfers:
    """Issues a step's loads and stores through ``link`` and tracks them.

    Each step sends one batched retrieve (every load of the step) and one batched
    store (every store), split only where the server's limits require
    (:meth:`~lmc_server.integration.link.link.ServerLink.store_batch`). ``stores`` is False
    on ranks that never store (replicated KV on a rank other than the storing one);
    those ranks still track store specs so they report ``finished_sending`` for every
    held request.
    """

    def __init__(
        self,
        link: ServerLink,
        tracker: TransferTracker,
        stores: bool = True,
        fence_timeout_s: float = 60.0,
    ) -> None:
        self.link = link
        self.tracker = tracker
        self.stores = stores
        self.fence_timeout_s = fence_timeout_s
        self._by_store_id: dict[int, Future[ChunkResult]] = {}

    def fence(self, store_ids: Iterable[int]) -> bool:
        """Wait for these stores: they read blocks the engine may write from now on.

        False when some did not finish within ``fence_timeout_s``: the connection is
        then dropped (and made anew), so the server aborts them rather than commit
        pages the engine may be rewriting."""
        futs = [f for i in store_ids if (f := self._by_store_id.pop(i, None)) is not None]
        if not futs:
            return True
        done, pending = wait_futures(futs, timeout=self.fence_timeout_s)
        # A store that timed out on this side may still be queued at a stalled server.
        unknown = [f for f in done if isinstance(f.exception(), TimeoutError)]
        if pending or unknown:
            logger.error(
                "%d stores without an answer at a fence (%.0f s); dropping the "
                "connection so the server aborts them (their blocks may be "
                "rewritten now)",
                len(pending) + len(unknown),
                self.fence_timeout_s,
            )
            self.link.reset()
        return not pending and not unknown

    def start_loads(
        self, loads: Sequence[LoadSpec], ready: Callable[[], None] | None = None
    ) -> None:
        """Start the step's loads, sent once ``ready()`` returned (see
        :meth:`~lmc_server.integration.link.link.ServerLink.retrieve_batch`)."""
        if not loads:
            return
        specs = list(loads)  # a step's StepLoads builds each LoadSpec as it is read
        futs = self.link.retrieve_batch([(s.digests, s.block_ids) for s in specs], ready)
        for spec, fut in zip(specs, futs, strict=True):
            self.tracker.load_started(spec, fut)

    def start_stores(
        self, stores: Sequence[StoreSpec], ready: Callable[[], None] | None = None
    ) -> None:
        for sid in [i for i, f in self._by_store_id.items() if f.done()]:
            del self._by_store_id[sid]
        futs: list[Future[ChunkResult] | None] = list(
            self.link.store_batch(
                [(s.digests, s.block_ids) for s in stores], ready, events=[s.events for s in stores]
            )
            if self.stores and stores
            else [None] * len(stores)
        )
        for spec, fut in zip(stores, futs, strict=True):
            self.tracker.store_planned(spec.req_id, fut)
            if fut is not None:
                self._by_store_id[spec.store_id] = fut

    def begin_step(self, plan: StepPlan) -> None:
        """Before the forward pass: fence, then start this step's loads."""
        self.fence(plan.fence_store_ids)
        self.start_loads(plan.loads)

    def wait_loads(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the loads in flight (so that they are reported
        in this step)."""
        futs = self.tracker.load_futures()
        if futs:
            wait_futures(futs, timeout=timeout_s)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every store and load in flight (shutdown);
        False when some are still running."""
        futs = self.tracker.store_futures() + self.tracker.load_futures()
        if not futs:
            return True
        _, pending = wait_futures(futs, timeout=timeout_s)
        if pending:
            logger.error(
                "%d transfers still running after %.0f s at shutdown; closing the "
                "connection (the server aborts unfinished stores)",
                len(pending),
                timeout_s,
            )
        return not pending
