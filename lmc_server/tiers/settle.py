"""Waiting for every future of a group, and consuming every exception they raised.

A tier call that fans out (a batch split over connections, reads in flight while the
next batch is prepared) ends when its first part fails, but the other parts still run
on their threads and, when the store is gone, fail too. asyncio logs a future whose
exception nobody retrieved, with its traceback, when the future is collected: one
traceback per part per batch, for what is one outage already reported once by the
tier. :func:`wait_all` waits for every part (a slot may still be written by a part
that has not ended) and :func:`consume` marks their exceptions retrieved; the caller
raises the first one, or nothing, as it decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


def consume(futures: Iterable[asyncio.Future[Any]]) -> list[BaseException]:
    """The exceptions of the done, not cancelled ``futures``, each marked retrieved."""
    out: list[BaseException] = []
    for f in futures:
        if f.done() and not f.cancelled():
            e = f.exception()
            if e is not None:
                out.append(e)
    return out


async def wait_all(futures: Iterable[asyncio.Future[Any]]) -> list[BaseException]:
    """Wait until every one of ``futures`` is done, also when the caller is cancelled
    meanwhile (the ``CancelledError`` is raised once all are done); their exceptions,
    consumed."""
    pending = set(futures)
    if not pending:
        return []
    try:
        await asyncio.shield(asyncio.wait(pending))
    except asyncio.CancelledError:
        await asyncio.wait(pending)
        consume(pending)
        raise
    return consume(pending)
