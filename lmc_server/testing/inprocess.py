"""The real :class:`~lmc_server.server.server.Server` on a thread of the test process.

Same event loop, same zmq socket and handlers as ``lmcache server``, but constructed in
process, so a test can hand it what a process cannot take: its own transfer engine (a
fake that fails on purpose), and a clock it moves by hand. With :class:`FakeClock`,
anything the server decides by time (lease expiry, idle sessions, the eviction log)
happens when the test advances the clock and the next housekeeping tick runs, not after
real seconds: :meth:`ThreadServer.wait_housekeeping` waits for that tick.

    clock = FakeClock()
    with run_server(clock=clock, lease_ttl_s=1.0) as ts:
        ...  # lookup takes a lease
        clock.advance(1.5)
        ts.wait_housekeeping()  # the lease has expired

A copy stuck in the engine is a state the test sets up the same way:
:class:`~lmc_server.testing.engines.HoldingEngine` holds copies until released, and
:meth:`ThreadServer.request_exit` does what SIGTERM does, so a drain is driven step by
step (``tests/server/test_lifecycle.py``).

Tests that need a process stay on :class:`~lmc_server.testing.process.ServerProcess`:
``kill -9``, signals, chaos, the CLI and the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from lmc_server.config import Config
from lmc_server.testing.process import free_port, wait_for_ping
from lmc_server.threadnames import name_os_thread
from lmc_server.transfer.base import TransferEngine

if TYPE_CHECKING:
    from lmc_server.server.notify import Notifier

#: Housekeeping period of :func:`run_server`: short, so that waiting for a tick after
#: :meth:`FakeClock.advance` takes milliseconds.
FAST_HOUSEKEEPING_S = 0.005


class FakeClock:
    """A monotonic clock (seconds) that moves only when :meth:`advance` is called.

    Read by the server's thread, moved by the test's: a float read or write is atomic
    under the GIL, and the lock keeps concurrent ``advance`` calls from losing time.
    """

    def __init__(self, start_s: float = 1000.0) -> None:
        self._now_s = start_s
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, f"a monotonic clock does not go back ({seconds} s)"
        with self._lock:
            self._now_s += seconds


class ThreadServer:
    """A :class:`Server` on a background thread with its own event loop.

    ``server_kwargs`` go to the :class:`Server` constructor (``clock``, ``notifier``,
    ``housekeeping_interval_s``).
    """

    def __init__(
        self, config: Config, engine: TransferEngine | None = None, **server_kwargs: Any
    ) -> None:
        self.config = config
        self.engine = engine
        self.server_kwargs = server_kwargs
        self.endpoint = config.endpoint
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code: int | None = None

    def start(self, timeout_s: float = 30.0, ready: bool = True) -> ThreadServer:
        """Start the server; return once it answers ping and (``ready``, the default)
        says it is ready to serve (a slab of its pool prepared: ``Pong.ready``), so a
        test's first request cannot meet a pool with nothing prepared on a loaded
        machine. The rest of the pool is prepared in the background as in a server
        process (a 1 GiB pool takes about a second here; the default here is 0.25 GiB,
        as :class:`~lmc_server.testing.process.ServerProcess`'s)."""
        from lmc_server.server.server import Server

        server = Server(self.config, engine=self.engine, **self.server_kwargs)
        self._server = server
        started = threading.Event()

        def run() -> None:
            name_os_thread("lmc-inproc-srv")
            loop = asyncio.new_event_loop()
            self._loop = loop
            started.set()
            try:
                self.exit_code = loop.run_until_complete(server.serve())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="lmc-thread-server", daemon=True)
        self._thread.start()
        started.wait()
        wait_for_ping(self.endpoint, timeout_s, ready=ready)
        return self

    @property
    def server(self) -> Any:
        """The :class:`Server` (tests read its counters; touch it only from its loop)."""
        return self._server

    def wait_housekeeping(self, ticks: int = 2, timeout_s: float = 10.0) -> None:
        """Return once ``ticks`` housekeeping ticks have started since the call.

        Two (the default) means one whole tick ran after the call: the tick that was
        under way when it was made may have read the clock before a preceding
        :meth:`FakeClock.advance`, the next one cannot. Waits milliseconds with the short
        period of :func:`run_server`; raises ``TimeoutError`` if the ticks stop.
        """
        server = self._server
        assert server is not None and ticks >= 1
        target = server.housekeeping_ticks + ticks
        deadline = time.monotonic() + timeout_s
        while server.housekeeping_ticks < target:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{ticks} housekeeping ticks did not run in {timeout_s} s "
                    f"(interval {server.housekeeping_interval_s} s)"
                )
            time.sleep(min(0.001, server.housekeeping_interval_s))

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the server's event loop (the only thread that may touch
        its state), soon; returns at once."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def request_exit(self) -> None:
        """What SIGTERM does to a server process: start the graceful shutdown (drain);
        returns at once. :meth:`stop` waits for the end."""
        assert self._server is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: it has stopped
            self.call_soon(self._server.handle_exit)

    def stop(self) -> None:
        if self._thread is None:
            return
        self.request_exit()
        self._thread.join(60)
        self._thread = None
        if self.exit_code not in (0, None):
            raise RuntimeError(f"in-process server exited with {self.exit_code}")


@contextlib.contextmanager
def run_server(
    config: Config | None = None,
    *,
    engine: TransferEngine | None = None,
    clock: FakeClock | None = None,
    notifier: Notifier | None = None,
    housekeeping_interval_s: float = FAST_HOUSEKEEPING_S,
    ready: bool = True,
    **config_fields: Any,
) -> Iterator[ThreadServer]:
    """A started :class:`ThreadServer`, stopped (and checked to exit 0) on leaving.

    Without ``config``, one is built from ``config_fields`` on a free loopback port with
    the cpu backend, a 0.25 GiB pool and no metrics endpoint. The server talks to systemd
    only through ``notifier`` (never to ``NOTIFY_SOCKET`` of the test's environment),
    and reads ``clock`` if one is given. It is returned once it is ready to serve
    (``ready=False``: once it answers ping at all).
    """
    from lmc_server.server.notify import Notifier

    if config is None:
        fields: dict[str, Any] = {
            "port": free_port(),
            "backend": "cpu",
            "l1_size_gb": 0.25,
            "metrics_port": 0,
        }
        config = Config(**(fields | config_fields))
    else:
        assert not config_fields, "pass either a Config or its fields, not both"
    kwargs: dict[str, Any] = {
        "notifier": Notifier(None) if notifier is None else notifier,
        "housekeeping_interval_s": housekeeping_interval_s,
    }
    if clock is not None:
        kwargs["clock"] = clock
    ts = ThreadServer(config, engine=engine, **kwargs).start(ready=ready)
    try:
        yield ts
    finally:
        ts.stop()
    assert ts.exit_code == 0, ts.exit_code
