"""Transfer engines for in-process tests: the CPU engine, with copies a test holds.

:class:`HoldingEngine` makes "a request stuck on a copy" a state the test controls
instead of a race against a copy's duration: each submission is held (not started)
until :meth:`HoldingEngine.release`, and :meth:`HoldingEngine.wait_held` returns once
the server has handed a copy over, that is once the request is in flight.
:class:`UnpreparedPoolEngine` does the same for the pool of a server that just started:
no slab is ready until the test says so. Hand one to
:func:`lmc_server.testing.inprocess.run_server`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.base import BufferMapping, DoneCallback, HostPool
from lmc_server.transfer.cpu import CpuEngine, CpuHostPool
from lmc_server.transfer.fd_inbox import FdInbox

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


class _SlabGate:
    """How many slabs a :class:`_HeldPool` may report ready so far."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._allowed = 0

    def allow(self, n: int) -> None:
        with self._cond:
            self._allowed = max(self._allowed, n)
            self._cond.notify_all()

    def wait_past(self, n: int) -> int:
        """Block until more than ``n`` slabs are allowed; how many are."""
        with self._cond:
            self._cond.wait_for(lambda: self._allowed > n)
            return self._allowed


class _HeldPool(CpuHostPool):
    """A CPU pool paged in as usual, whose slabs are reported (in order) only as far
    as its gate allows."""

    def __init__(self, size_bytes: int, slab_bytes: int, gate: _SlabGate) -> None:
        super().__init__(size_bytes, slab_bytes)
        self._gate = gate

    def start(self, on_ready: Callable[[int], None]) -> None:
        slabs: list[int] = []
        paged_in = threading.Event()

        def collect(slab: int) -> None:
            slabs.append(slab)
            if len(slabs) == self.n_slabs:
                paged_in.set()

        def report() -> None:
            paged_in.wait()
            sent = 0
            while sent < len(slabs):
                allowed = min(self._gate.wait_past(sent), len(slabs))
                for slab in slabs[sent:allowed]:
                    on_ready(slab)
                sent = allowed

        super().start(collect)
        threading.Thread(target=report, name="lmc-test-pool-hold", daemon=True).start()


class UnpreparedPoolEngine(CpuEngine):
    """The CPU engine, whose pool reports no slab ready until :meth:`prepare`.

    The state of a server in its first moments (on CUDA, pinning a pool takes long
    enough that clients can register, and send stores, before its first slab is
    ready, or before each object group's partition has one): the pool is paged in as
    usual, but the server hears of its slabs only as the test calls :meth:`prepare`."""

    def __init__(self, copy_threads: int = 2) -> None:
        super().__init__(copy_threads=copy_threads)
        self._gate = _SlabGate()

    def create_pool(self, size_bytes: int, slab_bytes: int) -> HostPool:
        self._pool = _HeldPool(size_bytes, slab_bytes, self._gate)
        if self._inbox is None:
            self._inbox = FdInbox()
        return self._pool

    def prepare(self, slabs: int | None = None) -> None:
        """Report the first ``slabs`` slabs of the pool ready (every slab without it);
        asking for fewer than already reported changes nothing."""
        self._gate.allow(1 << 30 if slabs is None else slabs)

    def close(self) -> None:
        self.prepare()
        super().close()
