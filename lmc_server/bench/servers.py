"""Servers the benchmarks talk to: a real process, or the same server in a thread.

Benchmarks run the server as a separate process (:class:`ServerProcess`), as users do.
The one exception: the configuration check refuses an L1 size larger than this
machine's memory even for ``--backend null``, which allocates nothing; a trace replay
at hundreds of GiB then runs the very same :class:`Server` on a thread of the benchmark
process, behind the same zmq socket, and says so in its notes. Tests use it too, to
run a server with an engine of their own (a fake that fails on purpose).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from lmc_server.config import Config, ConfigError
from lmc_server.testing.process import ServerProcess, free_port, wait_for_ping
from lmc_server.transfer.base import TransferEngine

log = logging.getLogger(__name__)


class RunningServer(Protocol):
    endpoint: str


class ThreadServer:
    """A :class:`Server` on a background thread with its own event loop."""

    def __init__(self, config: Config, engine: TransferEngine | None = None,
                 **server_kwargs: Any) -> None:
        self.config = config
        self.engine = engine
        self.server_kwargs = server_kwargs
        self.endpoint = config.endpoint
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code: int | None = None

    def start(self, timeout_s: float = 30.0) -> ThreadServer:
        from lmc_server.server.server import Server

        server = Server(self.config, engine=self.engine, **self.server_kwargs)
        self._server = server
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            started.set()
            try:
                self.exit_code = loop.run_until_complete(server.serve())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="lmc-bench-server", daemon=True)
        self._thread.start()
        started.wait()
        wait_for_ping(self.endpoint, timeout_s)
        return self

    @property
    def server(self) -> Any:
        """The :class:`Server` (tests read its counters; touch it only from its loop)."""
        return self._server

    def stop(self) -> None:
        from lmc_server.server.server import Server

        if self._thread is None:
            return
        assert self._loop is not None and isinstance(self._server, Server)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._server.handle_exit)
        self._thread.join(60)
        self._thread = None
        if self.exit_code not in (0, None):
            raise RuntimeError(f"in-process server exited with {self.exit_code}")


def fits_config_check(backend: str, l1_size_gb: float, slab_size_mb: int) -> str | None:
    """``None`` when ``lmcache server`` would accept these sizes, else its refusal."""
    try:
        Config(backend=backend, l1_size_gb=l1_size_gb, slab_size_mb=slab_size_mb).check()
    except ConfigError as e:
        return str(e)
    return None


@contextlib.contextmanager
def server(args: Sequence[str], backend: str, l1_size_gb: float, slab_size_mb: int = 64,
           chunk_size: int = 256, separate: bool = False, eviction_policy: str = "LRU",
           allow_thread: bool = False) -> Iterator[tuple[RunningServer, str]]:
    """Yield ``(server, how)``: ``how`` is ``"process"`` or ``"in-process"`` (why).

    ``args`` are extra command-line flags for the process; the named settings are
    passed to both kinds.
    """
    refusal = fits_config_check(backend, l1_size_gb, slab_size_mb)
    if refusal is None or not allow_thread:
        flags = ["--chunk-size", str(chunk_size), "--slab-size-mb", str(slab_size_mb),
                 "--eviction-policy", eviction_policy, "--log-level", "WARNING",
                 "--separate-object-groups" if separate else "--no-separate-object-groups",
                 *args]
        with ServerProcess(flags, backend=backend, l1_size_gb=l1_size_gb) as proc:
            yield proc, "process"
        return
    log.info("running the server in-process: %s", refusal)
    config = Config(port=free_port(), backend=backend, l1_size_gb=l1_size_gb,
                    slab_size_mb=slab_size_mb, chunk_size=chunk_size,
                    separate_object_groups=separate, eviction_policy=eviction_policy,
                    metrics_port=0, log_level="WARNING")
    ts = ThreadServer(config).start()
    try:
        yield ts, f"in-process (the config check refuses it as a process: {refusal})"
    finally:
        ts.stop()
