"""Engine completions back onto the event loop: one wake-up per request.

A data request submits its copies to the transfer engine (one part, see
:mod:`lmc_server.server.handlers`); each part reports its end by calling ``done(error)``
from whatever thread saw it finish. :class:`Completion`
counts those calls and wakes the request's coroutine once, when the last arrives
(``call_soon_threadsafe``, or directly when the last report comes from the loop's own
thread, as with engines that copy inline). It remembers each part's error and when the
last part ended (the end of the ``copy`` phase).

Two ways to be told: ``await completion.wait()``, or a callback given as ``then`` and
:meth:`Completion.seal` (a store or retrieve, which needs no task of its own: its end is
one callback on the loop, :meth:`~lmc_server.server.data_path.DataPath.start_store` and
``start_retrieve``; when every part reported before the seal, the caller runs it at
once).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Completion:
    """Waits for ``parts`` engine reports; ``await completion.wait()`` returns errors.

    Parts are added with :meth:`part` before they are submitted; a part that could not
    be submitted at all is reported through its callback by the caller, so every part
    reports exactly once.
    """

    __slots__ = (
        "_loop",
        "_loop_thread",
        "_lock",
        "_left",
        "_sealed",
        "errors",
        "started_at",
        "done_at",
        "_future",
        "_then",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, then: Callable[[], None] | None = None
    ) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._left = 0
        self._sealed = False
        #: The error of each part, ``""`` for success, in submission order.
        self.errors: list[str] = []
        #: ``perf_counter`` times at which the first part was added and the last reported.
        self.started_at = 0.0
        self.done_at = 0.0
        #: the callback of :meth:`seal` (then there is no future to await)
        self._then = then
        self._future: asyncio.Future[None] | None = None if then else loop.create_future()

    def part(self) -> DoneFn:
        """A callback for one more part; call it exactly once."""
        index = len(self.errors)
        if not index:
            self.started_at = time.perf_counter()
        self.errors.append("")
        with self._lock:
            self._left += 1
        return DoneFn(self, index)

    def _report(self, index: int, error: str) -> None:
        self.errors[index] = error
        with self._lock:
            self._left -= 1
            last = self._left == 0 and self._sealed
            if last:
                self.done_at = time.perf_counter()
        if last:
            self._wake()

    def _wake(self) -> None:
        if self._then is not None:
            if threading.get_ident() == self._loop_thread:
                self._loop.call_soon(self._then)
            else:
                self._loop.call_soon_threadsafe(self._then)
            return
        assert self._future is not None
        if threading.get_ident() == self._loop_thread:
            if not self._future.done():
                self._future.set_result(None)
        else:
            self._loop.call_soon_threadsafe(_resolve, self._future)

    def _seal(self) -> bool:
        with self._lock:
            self._sealed = True
            last = self._left == 0
            if last:
                self.done_at = time.perf_counter()
        return last

    def seal(self) -> bool:
        """Every part has been added (callback mode). True: each has reported already
        (an engine that copied inline), and the caller runs ``then`` itself, now, with
        no loop iteration in between; False: ``then`` runs on the loop when the last
        part reports. Either way ``then`` runs exactly once."""
        assert self._then is not None, "seal() is for a completion made with a callback"
        return self._seal()

    async def wait(self) -> list[str]:
        """Every part has been added: wait until each has reported; their errors."""
        assert self._future is not None, "wait() is for a completion made without a callback"
        if self._seal():
            return self.errors
        await self._future
        return self.errors


class DoneFn:
    """The ``done`` callback of one part (a small object rather than a closure).

    Only its first call counts: a second one (an engine that reported and then raised,
    so that the caller reports the failure too) would otherwise count another part as
    done and leave the request waiting for ever; it is logged as the bug it is."""

    __slots__ = ("_completion", "_index", "_called")

    def __init__(self, completion: Completion, index: int) -> None:
        self._completion = completion
        self._index = index
        self._called = False

    def __call__(self, error: str) -> None:
        if self._called:
            log.error("a copy reported its end twice (ignored; second report: %r)", error)
            return
        self._called = True
        self._completion._report(self._index, error)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
