"""Stores that lose a race wait for the winner: an honest reply instead of ``IN_PROGRESS``.

When replicated ranks store the same chunk at once, one reserves the key and copies; the
others find it WRITING. Answering those ``IN_PROGRESS`` would report a failure for a
chunk that is about to be there, so the losers wait (on the event loop, no polling: every
commit or abort wakes them) until each such key is settled:

* committed: ``EXISTS`` (the chunk is in L1, stored by the winner);
* gone (the winner's copy failed or its writer went away): ``FAILED``, nothing visible,
  the client may store it again;
* still WRITING after :data:`SETTLE_TIMEOUT_S`: ``IN_PROGRESS`` stays, meaning another
  store is still copying it; it may become visible later, count it as not stored.

At shutdown the wait is cut short: once the drain times out the server calls
:meth:`CommitWatch.close`, every waiting store returns at once (its undecided chunks
stay ``IN_PROGRESS``) and none waits again, so past the drain timeout the server waits
for copies only. (A writer that does not call :meth:`CommitWatch.changed`, such as an
L2 prefetch, would otherwise keep a store waiting up to the whole settle timeout after
the drain timeout.)

The timeout is the server's clock's: a waiting store also looks again when the
housekeeping tick finds its deadline passed (:meth:`CommitWatch.expire`), so a test
that moves a fake clock past the timeout sees the store answered at the next tick.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import numpy as np

from lmc_server.cache.index import L1Index
from lmc_server.cache.status import ChunkStatus
from lmc_server.cache.view import CacheView

#: Longest a store waits for other writers of its keys (a copy takes milliseconds).
SETTLE_TIMEOUT_S = 10.0


class CommitWatch:
    """Wakes waiting stores whenever any store commits or aborts (event-loop thread only)."""

    def __init__(
        self, index: L1Index, clock: Callable[[], float], timeout_s: float = SETTLE_TIMEOUT_S
    ) -> None:
        self.index = index
        self.clock = clock
        self.timeout_s = timeout_s
        self._changed: asyncio.Future[None] | None = None
        #: The earliest deadline of a waiting store (``clock`` time; inf: none).
        self._due_s = math.inf
        self._closed = False

    def close(self) -> None:
        """Shutdown, past the drain timeout: waiting stores return now, none waits again."""
        self._closed = True
        self.changed()

    def changed(self) -> None:
        """A store committed or aborted: let every waiter look again."""
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None
        self._due_s = math.inf  # every waiter names its deadline again

    def expire(self, now_s: float) -> None:
        """The housekeeping tick: wake the waiters once one's deadline has passed."""
        if now_s >= self._due_s:
            self.changed()

    async def settle(self, view: CacheView, keys: list[bytes], statuses: list[np.ndarray]) -> None:
        """Turn this request's ``IN_PROGRESS`` chunks into ``EXISTS`` or ``FAILED`` as
        their writers finish (in place), waiting up to ``timeout_s``."""
        if not any((st == ChunkStatus.IN_PROGRESS).any() for st in statuses):
            return
        deadline = self.clock() + self.timeout_s
        while True:
            waiting = self.index.settle_in_progress(view, keys, statuses)
            left = deadline - self.clock()
            if not waiting or left <= 0 or self._closed:
                return
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            self._due_s = min(self._due_s, deadline)
            try:
                await asyncio.wait_for(asyncio.shield(self._changed), left)
            except TimeoutError:
                pass
