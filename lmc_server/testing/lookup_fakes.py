"""Lookup-service fakes for the planner's tests: answers the test sets by hand on
futures, handed to the planner as the :class:`~lmc_server.integration.plans.LookupBatch`
the real service (the link) returns."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import Future

from lmc_server.integration.plans import LookupAnswer, LookupBatch


def batch_of(futures: Sequence[Future[LookupAnswer]]) -> LookupBatch:
    """A batch whose lookup ``i`` is answered with ``futures[i]``'s outcome (its result,
    or its exception) when the test sets it."""
    batch = LookupBatch(len(futures))
    for i, fut in enumerate(futures):
        fut.add_done_callback(functools.partial(_copy, batch, i))
    return batch


def _copy(batch: LookupBatch, i: int, fut: Future[LookupAnswer]) -> None:
    exc = fut.exception()
    if exc is not None:
        batch.set(error=exc, at=[i])
    else:
        batch.set([fut.result()], at=[i])
