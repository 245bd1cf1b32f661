"""The L2 tier: one remote store behind L1, written behind and prefetched on lookup.

The server makes one :class:`L2Tier` when ``--l2`` is set and calls it at exactly two
points: :meth:`on_commit` after a store committed (queue the objects for L2) and
:meth:`on_lookup` after a lookup hit less than it asked (start a prefetch). With no
``--l2`` there is no tier and each hook costs the server one ``is None`` test.

Failure handling. The tier is ``up`` or ``degraded``. It starts degraded and a
supervisor task connects; any call that finds the store unreachable turns it degraded
and wakes the supervisor, which reconnects with exponential backoff
(``BACKOFF_MIN_S`` .. ``BACKOFF_MAX_S``). Each change of state is logged once. While
degraded, writes are dropped (counted) and no prefetch starts: L1 serves exactly as
without L2, and nothing in L1 is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lmc_server.cache.index import L1Index, StoreTicket
from lmc_server.cache.view import CacheView
from lmc_server.threadnames import name_os_thread
from lmc_server.tiers import codec
from lmc_server.tiers.backend import L2Backend, L2Error
from lmc_server.tiers.context import TierContext
from lmc_server.tiers.events import TierListeners
from lmc_server.tiers.poolview import PoolView
from lmc_server.tiers.prefetch import Prefetcher
from lmc_server.tiers.stats import L2Stats
from lmc_server.tiers.writer import WriteBehind

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 5.0
#: Threads that build values (checksum, copy) and verify and copy fetched ones.
L2_THREADS = 4


class L2Tier:
    """Write-behind, prefetch and the connection state of one L2 store.

    ``clock`` is the server's: how long a known miss is remembered and how long the
    tier has been in its state are read from it, so a test's fake clock moves them.
    """

    def __init__(
        self,
        backend: L2Backend,
        display_url: str,
        index: L1Index,
        view: PoolView,
        chunk_size: int,
        write_queue_objects: int,
        prefetch_max_chunks: int,
        timeout_s: float,
        clock: Callable[[], float],
        kind: str = "l2",
        pin_budget_bytes: int = 0,
    ) -> None:
        self.backend = backend
        #: ``"l2"`` (a shared store) or ``"disk"``: names the tier in logs and reports.
        self.kind = kind
        self.label = "L2" if kind == "l2" else kind
        self.listeners: TierListeners = getattr(backend, "listeners", None) or TierListeners(kind)
        self.display_url = display_url
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self.clock = clock
        self.stats = L2Stats()
        self.up = False
        self.state_reason = "connecting"
        #: The first connect after the start is under way (writes wait for it).
        self.connecting = True
        self.state_since_s = clock()
        self._spaces: dict[tuple[str, bytes], bytes] = {}
        self._executor = ThreadPoolExecutor(
            L2_THREADS, thread_name_prefix="lmc-l2", initializer=name_os_thread
        )
        #: What the write-behind and the prefetcher share (one of each per tier).
        self.context = TierContext(
            index,
            backend,
            self.stats,
            view,
            self._executor,
            self.space,
            self.is_up,
            self.failed,
            clock,
            self.is_connecting,
        )
        self.writer = WriteBehind(
            self.context,
            write_queue_objects,
            self.listeners.stored,
            pin_budget_bytes,
            f"{self.label} {display_url}",
        )
        self.prefetcher = Prefetcher(self.context, prefetch_max_chunks)
        self._down = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = False
        self._view = view

    # -- hooks (event loop) ----------------------------------------------------------

    def on_commit(self, namespace: str, ticket: StoreTicket) -> None:
        """A store committed ``ticket``'s objects: queue them for L2."""
        self.writer.enqueue(namespace, ticket)
        self.prefetcher.committed(ticket)

    def on_lookup(self, view: CacheView, namespace: str, keys: list[bytes], hit: int) -> int:
        """A lookup hit ``hit`` of ``len(keys)`` chunks: chunks now being fetched."""
        if hit >= len(keys):
            return 0
        return self.prefetcher.start(view, namespace, keys, hit)

    # -- state -----------------------------------------------------------------------

    def space(self, namespace: str, fingerprint: bytes) -> bytes:
        key = (namespace, fingerprint)
        sp = self._spaces.get(key)
        if sp is None:
            sp = self._spaces[key] = codec.space_of(namespace, fingerprint, self.chunk_size)
        return sp

    def is_up(self) -> bool:
        return self.up

    def is_connecting(self) -> bool:
        return self.connecting

    def _set_state(self, up: bool, reason: str) -> None:
        if up == self.up and reason == self.state_reason:
            return
        changed = up != self.up
        self.up, self.state_reason = up, reason
        if changed:
            self.state_since_s = self.clock()
            self.stats.state_changes += 1
            if up:
                log.info("%s %s: connected", self.label, self.display_url)
            else:
                log.warning(
                    "%s %s degraded (serving from L1 only): %s",
                    self.label,
                    self.display_url,
                    reason,
                )

    def failed(self, err: L2Error) -> None:
        """A call failed; an unreachable store makes the tier degraded (reconnects)."""
        if not err.unavailable:
            log.debug("L2 refused a call: %s", err)
            return
        if self.up:
            self._set_state(False, str(err))
        self._down.set()

    async def _supervise(self) -> None:
        delay_s = BACKOFF_MIN_S
        first = True
        while not self._closing:
            if self.up:
                await self._down.wait()
                self._down.clear()
                continue
            try:
                await asyncio.wait_for(self.backend.connect(), self.timeout_s * 2)
            except (L2Error, TimeoutError) as e:
                if first:
                    log.warning(
                        "%s %s unreachable at start (serving from L1 only, retrying): %s",
                        self.label,
                        self.display_url,
                        e,
                    )
                    self.state_reason = str(e)
                    first = False
                    self.connecting = False
                    self.writer.drop_all("l2_down")
                else:
                    self._set_state(False, str(e) or type(e).__name__)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, BACKOFF_MAX_S)
                continue
            first = False
            delay_s = BACKOFF_MIN_S
            self._down.clear()
            self._set_state(True, "connected")
            self.connecting = False
            self.writer.wake()

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._supervisor = asyncio.get_running_loop().create_task(
            self._supervise(), name="l2-supervisor"
        )
        self.writer.start()

    async def drain(self, timeout_s: float) -> None:
        """Shutdown, first step: write out what is queued (at most ``timeout_s``)."""
        await self.writer.drain(timeout_s)

    async def stop(self) -> None:
        """Finish what touches the pool, then drop the rest and close the store.

        Returns only once no tier thread can touch the pool (the pool is freed next).
        """
        self._closing = True
        self._down.set()
        await self.prefetcher.stop(self.timeout_s + 1)
        await self.writer.stop(self.timeout_s + 1)
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        self._view.release()
        await self.backend.shutdown()

    # -- reporting -------------------------------------------------------------------

    def health(self) -> str:
        """One phrase for /healthz (the server serves either way)."""
        if self.up:
            extra = self.backend.status()
            return f"{self.label} {self.display_url} up" + (f" ({extra})" if extra else "")
        return f"{self.label} {self.display_url} degraded: {self.state_reason}"
