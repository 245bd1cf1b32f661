"""A connection to the server driven from a background thread, for engine hooks.

Engine hooks are synchronous and must not wait on the network. :class:`ServerLink`
runs an :class:`~lmc_server.client.aio.AsyncClient` on its own event-loop thread;
every call returns a :class:`concurrent.futures.Future` at once, and many requests may
be in flight on the one connection.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from lmc_server.cache.geometry import BufferSpec, GroupSpec
from lmc_server.client.aio import AsyncClient
from lmc_server.client.core import BlockIds, ChunkResult, Registration
from lmc_server.integration.planning import LookupAnswer

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ServerLink:
    """One registration on one server, usable from any thread.

    ``register`` blocks (once, at start-up); every other call is asynchronous.
    """

    def __init__(self, endpoint: str, timeout_s: float = 30.0, client_name: str = "") -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="lmc-server-link", daemon=True)
        self._thread.start()
        self._client: AsyncClient = self.wait(AsyncClient.connect(
            endpoint, timeout_s=timeout_s, client_name=client_name))
        self.registration: Registration | None = None

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result(self.timeout_s + 5.0)

    @property
    def reg(self) -> Registration:
        assert self.registration is not None, "ServerLink used before register()"
        return self.registration

    def register(self, *, model: str, kv_dtype: str, arch: str, groups: Sequence[GroupSpec],
                 buffers: Sequence[BufferSpec] = (), world_size: int = 1, rank: int = 0,
                 replicated: bool = False) -> Registration:
        self.registration = self.wait(self._client.register(
            model=model, kv_dtype=kv_dtype, arch=arch, groups=groups, buffers=buffers,
            world_size=world_size, rank=rank, replicated=replicated))
        logger.info("registered with %s: namespace %s, chunk size %d, %d object groups%s",
                    self.endpoint, self.registration.namespace, self.registration.chunk_size,
                    len(self.registration.object_groups),
                    " (lookup only)" if self.registration.lookup_only else "")
        return self.registration

    # -- LookupService ------------------------------------------------------------------

    def lookup(self, digests: bytes) -> Future[LookupAnswer]:
        async def run() -> LookupAnswer:
            r = await self._client.lookup(self.reg, digests, lease=True)
            return LookupAnswer(r.hit_chunks, r.lease_id, r.lease_ttl_s)

        return self.submit(run())

    def release(self, lease_id: int) -> None:
        fut = self.submit(self._client.release(lease_id))
        fut.add_done_callback(_log_failure("release"))

    # -- transfers ----------------------------------------------------------------------

    def store(self, digests: bytes, block_ids: BlockIds,
              ready: Callable[[], None] | None = None) -> Future[ChunkResult]:
        """Store once ``ready()`` (blocking: the engine's writes finished) returned; it
        runs on a worker thread, so neither the engine nor this link's loop waits."""
        async def run() -> ChunkResult:
            if ready is not None:
                await asyncio.get_running_loop().run_in_executor(None, ready)
            return await self._client.store(self.reg, digests, block_ids)

        return self.submit(run())

    def retrieve(self, digests: bytes, block_ids: BlockIds) -> Future[ChunkResult]:
        return self.submit(self._client.retrieve(self.reg, digests, block_ids))

    def close(self) -> None:
        if not self._loop.is_running():
            return
        try:
            if self.registration is not None:
                self.wait(self._client.unregister(self.registration))
        except Exception as exc:  # the server may be gone at shutdown
            logger.debug("unregister at close failed: %s", exc)
        try:
            self.wait(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
            if not self._thread.is_alive():
                self._loop.close()


def _log_failure(what: str) -> Any:
    def cb(fut: Future[Any]) -> None:
        exc = fut.exception()
        if exc is not None:
            logger.warning("%s failed: %s", what, exc)

    return cb
