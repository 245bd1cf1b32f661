"""What scheduler-side planning exchanges with the rest of the connector.

In: :class:`ScheduledRequest` (what the adapter reads from the engine each step) and
:class:`LookupAnswer` (the server's answer, through a :class:`LookupService`). Out:
:class:`StepPlan`, the loads and stores the workers run in one engine step
(:mod:`lmc_server.integration.worker`). Plain values, so the planner, the link and the
workers depend on these and not on each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

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


class LookupService(Protocol):
    """The scheduler's link to the server (a lookup-only registration)."""

    def lookup(self, digests: bytes) -> Future[LookupAnswer]: ...

    def lookup_batch(self, prefixes: Sequence[bytes]) -> list[Future[LookupAnswer]]: ...

    def release(self, lease_id: int) -> None: ...


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Retrieve chunks ``0..n`` of a request into its blocks (``-1``: leave alone)."""

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

