"""Servers the benchmarks talk to: a real process, or the same server in a thread.

Benchmarks run the server as a separate process (:class:`ServerProcess`), as users do.
The one exception: the configuration check refuses an L1 size larger than this
machine's memory even for ``--backend null``, which allocates nothing; a trace replay
at hundreds of GiB then runs the very same :class:`Server` on a thread of the benchmark
process, behind the same zmq socket, and says so in its notes. That in-process server
is :class:`lmc_server.testing.inprocess.ThreadServer` (importable from here too), which
tests use with engines and clocks of their own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Protocol

from lmc_server.bench.common import DEFAULT_CHUNK_SIZE
from lmc_server.config import Config, ConfigError
from lmc_server.testing.inprocess import ThreadServer
from lmc_server.testing.process import ServerProcess, free_port, wait_pool_ready

log = logging.getLogger(__name__)


class RunningServer(Protocol):
    endpoint: str


def server_flags(chunk_size: int, separate: bool, *extra: str, copy_mode: str = "") -> list[str]:
    """A benchmark server's flags: its chunk size and object-group layout, warnings only
    in its log, ``copy_mode`` as ``--cuda-copy-mode`` (``staging:N`` also sets
    ``--cuda-staging-mb N``), then ``extra``."""
    name, _, staging_mb = copy_mode.partition(":")
    flags = ["--chunk-size", str(chunk_size), "--log-level", "WARNING"]
    flags.append("--separate-object-groups" if separate else "--no-separate-object-groups")
    if name:
        flags += ["--cuda-copy-mode", name]
    if staging_mb:
        flags += ["--cuda-staging-mb", staging_mb]
    return [*flags, *extra]


def fits_config_check(backend: str, l1_size_gb: float, slab_size_mb: int) -> str | None:
    """``None`` when ``lmcache server`` would accept these sizes, else its refusal."""
    try:
        Config(backend=backend, l1_size_gb=l1_size_gb, slab_size_mb=slab_size_mb).check()
    except ConfigError as e:
        return str(e)
    return None


@contextlib.contextmanager
def server(
    args: Sequence[str],
    backend: str,
    l1_size_gb: float,
    slab_size_mb: int = 64,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    separate: bool = False,
    eviction_policy: str = "LRU",
    allow_thread: bool = False,
) -> Iterator[tuple[RunningServer, str]]:
    """Yield ``(server, how)``: ``how`` is ``"process"`` or ``"in-process"`` (why).

    ``args`` are extra command-line flags for the process; the named settings are
    passed to both kinds. Yields once every slab of the pool is prepared: a benchmark
    measures a ready server (a store before the first slab is answered ``busy``).
    """
    refusal = fits_config_check(backend, l1_size_gb, slab_size_mb)
    if refusal is None or not allow_thread:
        more = ["--slab-size-mb", str(slab_size_mb), "--eviction-policy", eviction_policy]
        flags = server_flags(chunk_size, separate, *more, *args)
        with ServerProcess(flags, backend=backend, l1_size_gb=l1_size_gb) as proc:
            proc.wait_pool_ready()
            yield proc, "process"
        return
    log.info("running the server in-process: %s", refusal)
    config = Config(
        port=free_port(),
        backend=backend,
        l1_size_gb=l1_size_gb,
        slab_size_mb=slab_size_mb,
        chunk_size=chunk_size,
        separate_object_groups=separate,
        eviction_policy=eviction_policy,
        metrics_port=0,
        log_level="WARNING",
    )
    ts = ThreadServer(config).start()
    try:
        wait_pool_ready(ts.endpoint)
        yield ts, f"in-process (the config check refuses it as a process: {refusal})"
    finally:
        ts.stop()


__all__ = ["RunningServer", "ThreadServer", "fits_config_check", "server", "server_flags"]
