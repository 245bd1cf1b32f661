"""Transfer engines for in-process tests: the CPU engine, with copies a test holds.

:class:`HoldingEngine` makes "a request stuck on a copy" a state the test controls
instead of a race against a copy's duration: each submission is held (not started)
until :meth:`HoldingEngine.release`, and :meth:`HoldingEngine.wait_held` returns once
the server has handed a copy over, that is once the request is in flight. Hand one
to :func:`lmc_server.testing.inprocess.run_server`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.base import BufferMapping, DoneCallback
from lmc_server.transfer.cpu import CpuEngine

_Submission = tuple[asyncio.AbstractEventLoop, BufferMapping, Sequence[RunCopy], bool, DoneCallback]


class HoldingEngine(CpuEngine):
    """The CPU engine, holding every submission while :attr:`holding` is set.

    Real bytes, real completions: a released submission is copied by the CPU engine
    exactly as if it had just been submitted. Release before stopping the server: a
    server drains (waits for) copies in flight, and a held copy never finishes.
    """

    def __init__(self, holding: bool = True, copy_threads: int = 2) -> None:
        super().__init__(copy_threads=copy_threads)
        self.holding = holding
        self._held: list[_Submission] = []
        self._cond = threading.Condition()
        #: Submissions seen so far (held or not).
        self.submissions = 0

    def submit(
        self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool, done: DoneCallback
    ) -> None:
        with self._cond:
            self.submissions += 1
            if self.holding:  # called on the server's loop (the engine contract)
                self._held.append((asyncio.get_running_loop(), mapping, copies, to_pool, done))
                self._cond.notify_all()
                return
        super().submit(mapping, copies, to_pool, done)

    def wait_held(self, n: int = 1, timeout_s: float = 10.0) -> None:
        """Return once ``n`` submissions are held; ``TimeoutError`` otherwise."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._held) >= n, timeout_s):
                raise TimeoutError(
                    f"{len(self._held)} of {n} copies reached the engine within {timeout_s} s"
                )

    def hold(self) -> None:
        """Hold every submission from now on (until :meth:`release`)."""
        with self._cond:
            self.holding = True

    def release(self) -> int:
        """Stop holding, and start every held copy where the server starts copies: on
        its event loop (a copy started from the test's thread could still hold the pool
        in a frame after ``done``, while the server, woken by it, frees the pool).
        Returns how many there were."""
        with self._cond:
            self.holding = False
            held, self._held = self._held, []
        for loop, mapping, copies, to_pool, done in held:
            loop.call_soon_threadsafe(self._start, mapping, copies, to_pool, done)
        return len(held)

    def _start(
        self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool, done: DoneCallback
    ) -> None:
        try:
            super().submit(mapping, copies, to_pool, done)
        except Exception as e:  # the server's own submit reports this way too
            done(f"copy not started: {e}")


class BackloggedEngine(CpuEngine):
    """The CPU engine with one copy thread, kept busy until :meth:`release`: copies
    larger than ``INLINE_BYTES`` that are submitted meanwhile queue behind it, as they do
    behind other copies on a loaded server (a backlog the test controls).
    :attr:`submitted` counts submissions once the engine has queued them."""

    def __init__(self) -> None:
        super().__init__(copy_threads=1)
        self._gate = threading.Event()
        self._executor.submit(self._gate.wait, 60.0)
        self._cond = threading.Condition()
        self.submitted = 0

    def submit(
        self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool, done: DoneCallback
    ) -> None:
        super().submit(mapping, copies, to_pool, done)
        with self._cond:
            self.submitted += 1
            self._cond.notify_all()

    def wait_submitted(self, n: int = 1, timeout_s: float = 10.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.submitted >= n, timeout_s):
                raise TimeoutError(f"{self.submitted} of {n} copies submitted in {timeout_s} s")

    def release(self) -> None:
        """Free the copy thread: the queued copies run (or are skipped if stopped)."""
        self._gate.set()

    def close(self) -> None:
        self.release()
        super().close()
