"""A connection to the server driven from a background thread, for engine hooks.

Engine hooks are synchronous and must not wait on the network. :class:`ServerLink`
runs an :class:`~lmc_server.client.aio.AsyncClient` on its own event-loop thread;
every call returns a :class:`concurrent.futures.Future` at once, and many requests may
be in flight on the one connection.

Batches and back-pressure. :meth:`ServerLink.store_batch` and
:meth:`ServerLink.retrieve_batch` carry the chunks of many engine requests in one
server request (chunk digests are independent keys; a batched retrieve names where
each prefix ends, so sliding windows are read at every request's end), split only
where the server's ``max_chunks_per_request`` or frame limit requires, and retrieves
also at :data:`~lmc_server.integration.link.batches.LOAD_PART_CHUNKS` (those batches are
:mod:`.batches`; a reply comes when its whole request is done, so
the loads of one busy step finish part by part, not all at the last). At most
``max_inflight`` stores and retrieves are in flight on the connection (below the
server's per-client limit); more wait in a queue, and a ``busy`` refusal is retried
until ``timeout_s``. A transfer therefore fails only for a reason that persists:
never because the connection was momentarily full.

Lookups (:mod:`.lookups`): the lookups of many engine requests go out as one or a
few ``lookup_batch`` requests (each answered as a lookup, with a lease of its own),
hashed on the link's thread, so the scheduler thread neither hashes nor pays a message
per request.

A restarted server. The server forgets registrations when it restarts (or drops a
session it thought dead); zmq reconnects the socket by itself and the next request is
refused (``handshake`` or ``unknown_registration``). The link then connects afresh,
registers again with the same arguments and retries the request once; a lookup,
store or retrieve fails only if that fails too. Shared-memory segments are handed to
the new server process by descriptor like to the first (:mod:`lmc_server.client.shm`),
so this holds on the cpu backend as on CUDA.

A server that died with requests in flight. Their replies will never come, and waiting
for ``timeout_s`` would stall whatever waits on them (a fence stops the whole engine).
When the connection drops with requests in flight, the link probes the endpoint until a
server answers: one whose uptime is shorter than the time since the drop is a new
process, and since only one process can listen on the port, the one that had the
requests is gone. Every request in flight then fails at once (a failed store is simply
not cached; a failed load is reported failed) and the link connects afresh. A server
that answers with a longer uptime is the same one, silent for a while (zmq's heartbeat
dropped the connection): it may still run those requests, so they keep waiting for
their reply or ``timeout_s``, as before.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from lmc_server.buffers import BufferSpec
from lmc_server.cache.geometry import GroupSpec
from lmc_server.client.aio import AsyncClient
from lmc_server.client.core import ChunkResult, Registration, ServerError
from lmc_server.integration.link.batches import BatchedTransfers
from lmc_server.integration.link.lookups import BatchedLookups

logger = logging.getLogger(__name__)

T = TypeVar("T")

BUSY_RETRY_FIRST_S = 0.002
BUSY_RETRY_MAX_S = 0.05
#: Stores and retrieves this link keeps in flight; the server refuses more than its
#: ``max_inflight_per_client`` (64 by default) with ``busy``.
DEFAULT_MAX_INFLIGHT = 16

#: How long one probe of a lost server waits for its answer, and the pause between
#: probes (:meth:`ServerLink._fail_if_restarted`).
PROBE_TIMEOUT_S = 0.5
PROBE_INTERVAL_S = 0.05

#: Refusals that mean "the server does not know this connection or registration".
RECONNECT_CODES = frozenset({"handshake", "unknown_registration"})


class ServerLink(BatchedLookups, BatchedTransfers):
    """One registration on one server, usable from any thread.

    ``register`` blocks (once, at start-up); every other call is asynchronous.
    """

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 30.0,
        client_name: str = "",
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.client_name = client_name
        self.requests_sent = {"store": 0, "retrieve": 0}
        self.busy_retries = 0
        self.reconnects = 0
        self._register_kwargs: dict[str, Any] | None = None
        self._reconnect_lock = asyncio.Lock()
        self._broken = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="lmc-server-link", daemon=True
        )
        self._thread.start()
        self.restarts_detected = 0
        self._release_lock = threading.Lock()
        self._releases: list[int] = []
        self._client: AsyncClient = self.wait(
            AsyncClient.connect(endpoint, timeout_s=timeout_s, client_name=client_name)
        )
        self._watch(self._client)
        self.registration: Registration | None = None
        self._slots = self.wait(_make_semaphore(max_inflight))
        welcome = self._client.welcome
        assert welcome is not None
        self.max_chunks = int(welcome.max_chunks_per_request)
        self.max_frame_bytes = int(welcome.max_frame_bytes)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result(self.timeout_s + 5.0)

    @property
    def reg(self) -> Registration:
        assert self.registration is not None, "ServerLink used before register()"
        return self.registration

    def register(
        self,
        *,
        model: str,
        kv_dtype: str,
        arch: str,
        groups: Sequence[GroupSpec],
        buffers: Sequence[BufferSpec] = (),
        world_size: int = 1,
        rank: int = 0,
        replicated: bool = False,
    ) -> Registration:
        if self.registration is not None:  # registering anew replaces the old one
            self.wait(self._client.unregister(self.registration))
            self.registration = None
        self._register_kwargs = dict(
            model=model,
            kv_dtype=kv_dtype,
            arch=arch,
            groups=list(groups),
            buffers=list(buffers),
            world_size=world_size,
            rank=rank,
            replicated=replicated,
        )
        self.registration = self.wait(self._client.register(**self._register_kwargs))
        logger.info(
            "registered with %s: namespace %s, chunk size %d, %d object groups%s",
            self.endpoint,
            self.registration.namespace,
            self.registration.chunk_size,
            len(self.registration.object_groups),
            " (lookup only)" if self.registration.lookup_only else "",
        )
        return self.registration

    async def _reconnect(self, seen: AsyncClient) -> None:
        """Connect and register afresh, unless another request already did."""
        async with self._reconnect_lock:
            if self._client is not seen and not self._broken:
                return
            seen = self._client
            logger.warning("connecting to %s and registering again", self.endpoint)
            client = await AsyncClient.connect(
                self.endpoint, timeout_s=self.timeout_s, client_name=self.client_name
            )
            try:
                if self._register_kwargs is not None:
                    self.registration = await client.register(**self._register_kwargs)
            except BaseException:
                await client.close()
                raise
            self._client = client
            self._watch(client)
            self._broken = False
            self.reconnects += 1
            await seen.close()

    def _watch(self, client: AsyncClient) -> None:
        def lost() -> None:
            if client is self._client and client.in_flight and not self._broken:
                self._loop.create_task(self._fail_if_restarted(client, self._loop.time()))

        client.on_connection_lost(lost)

    async def _fail_if_restarted(self, client: AsyncClient, lost_at: float) -> None:
        """After ``client``'s connection dropped at ``lost_at`` with requests in flight:
        fail them at once if the server that answers now started after the drop (see
        the module docstring); otherwise leave them to their reply or timeout."""
        deadline = lost_at + self.timeout_s
        while client is self._client and client.in_flight and self._loop.time() < deadline:
            try:
                probe = await AsyncClient.connect(
                    self.endpoint,
                    timeout_s=PROBE_TIMEOUT_S,
                    client_name=f"{self.client_name}-probe",
                )
                try:
                    uptime_s = (await probe.stats()).uptime_s
                finally:
                    await probe.close()
            except (TimeoutError, ConnectionError, ServerError):
                await asyncio.sleep(PROBE_INTERVAL_S)
                continue
            if uptime_s < self._loop.time() - lost_at and client is self._client:
                logger.warning(
                    "server at %s restarted with %d requests in flight; failing them now",
                    self.endpoint,
                    client.in_flight,
                )
                self.restarts_detected += 1
                self._broken = True
                await client.close()
            return

    def reset(self) -> None:
        """Close this connection now; the next request connects and registers afresh.

        The server ends the old session: stores it has not committed are aborted,
        never made visible. A fence that timed out uses this, since the blocks its
        store reads may be rewritten from now on. Returns without waiting for the
        server (it may be the one that is stalled)."""
        self._broken = True
        self.wait(self._client.close())

    async def _request(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self._client.<method>(registration, ...)``, reconnecting once if the server
        forgot this link."""
        for attempt in (0, 1):
            client = self._client
            if self._broken:
                await self._reconnect(client)
                client = self._client
            try:
                return await getattr(client, method)(self.reg, *args, **kwargs)
            except ServerError as e:
                if e.code not in RECONNECT_CODES or attempt:
                    raise
            except ConnectionError:
                if attempt or client is self._client:  # not closed by a reconnect
                    raise
                continue
            await self._reconnect(client)
        raise AssertionError("unreachable")

    # -- LookupService (lookups: link/lookups.py) ------------------------------------

    def release(self, lease_id: int) -> None:
        """Give a lease back, without waiting. Releases asked for together (one engine
        step's) go out from one hop onto the link's thread."""
        with self._release_lock:
            self._releases.append(lease_id)
            if len(self._releases) > 1:
                return  # a hop is already scheduled
        self._loop.call_soon_threadsafe(self._send_releases)

    def _send_releases(self) -> None:
        with self._release_lock:
            ids, self._releases = self._releases, []
        for lease_id in ids:
            task = self._loop.create_task(self._client.release(lease_id))
            task.add_done_callback(_log_task_failure("release"))

    # -- transfers ----------------------------------------------------------------------

    async def _send(self, op: str, *args: Any, **kwargs: Any) -> ChunkResult:
        """One store or retrieve, queued behind ``max_inflight``; ``busy`` is retried."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pause = BUSY_RETRY_FIRST_S
        async with self._slots:
            while True:
                try:
                    self.requests_sent[op] += 1
                    result: ChunkResult = await self._request(op, *args, **kwargs)
                    return result
                except ServerError as e:
                    if e.code != "busy" or loop.time() + pause > deadline:
                        raise
                except TimeoutError:
                    # No answer: a stalled server may still run it later, reading or
                    # writing blocks the engine reuses once this failure is reported.
                    # Dropping the connection ends the session, so it does not.
                    if not self._broken:
                        self._broken = True
                        await self._client.close()
                    raise
                self.busy_retries += 1
                await asyncio.sleep(pause)
                pause = min(pause * 2, BUSY_RETRY_MAX_S)

    def close(self, unregister_timeout_s: float | None = None) -> None:
        """Unregister (waiting at most ``unregister_timeout_s``, default the link's
        timeout) and close the connection. A server that does not answer sees the
        connection close instead, which ends the registration the same way: its
        unfinished stores are aborted, never made visible."""
        if not self._loop.is_running():
            return
        wait_s = self.timeout_s if unregister_timeout_s is None else unregister_timeout_s
        try:
            if self.registration is not None and not self._broken:
                self.submit(self._client.unregister(self.registration)).result(wait_s)
        except Exception as exc:  # the server may be gone or stalled at shutdown
            logger.debug("unregister at close failed: %r", exc)
        try:
            if not self._broken:
                self.wait(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)
            if not self._thread.is_alive():
                self._loop.close()


async def _make_semaphore(n: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(n)


def _log_task_failure(what: str) -> Any:
    def cb(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("%s failed: %s", what, task.exception())

    return cb
