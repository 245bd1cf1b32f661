"""The Mooncake Store adapter (``mooncake://MASTER_HOST:PORT?metadata=URL``).

Mooncake's Python client (``mooncake.store.MooncakeDistributedStore`` from the
``mooncake-transfer-engine`` packages; the ``-non-cuda`` build on hosts without the
CUDA driver) is synchronous, so every call runs on this adapter's single thread and the
event loop only awaits it. The client also contributes memory to the store (its
"global segment", ``segment_mb`` in the URL query, default 256) over the TCP
transport. Keys are the L2 keys in hex (Mooncake keys are strings); a missing key reads
as an empty value. Query options: ``metadata`` (the master's HTTP metadata server,
default ``http://HOST:8080/metadata``), ``segment_mb``, ``buffer_mb``,
``local_hostname`` (default 127.0.0.1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs, urlsplit

from lmc_server.threadnames import name_os_thread
from lmc_server.tiers.backend import L2Backend, L2Error, Value

MIB = 1 << 20


class MooncakeBackend(L2Backend):
    name = "mooncake"

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        host = parts.hostname or "127.0.0.1"
        self.master = f"{host}:{parts.port or 50051}"
        self.metadata = query.get("metadata", f"http://{host}:8080/metadata")
        self.segment_bytes = int(query.get("segment_mb", "256")) * MIB
        self.buffer_bytes = int(query.get("buffer_mb", "64")) * MIB
        self.local_hostname = query.get("local_hostname", "127.0.0.1")
        self.timeout_s = timeout_s
        self._store: Any = None
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="lmc-mooncake", initializer=name_os_thread
        )

    async def _call(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, fn, *args)

    def _setup(self) -> Any:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise L2Error(
                f"mooncake: the client is not installed or cannot load: {e}", unavailable=True
            ) from None
        store = MooncakeDistributedStore()
        rc = store.setup(
            self.local_hostname,
            self.metadata,
            self.segment_bytes,
            self.buffer_bytes,
            "tcp",
            "",
            self.master,
        )
        if rc != 0:
            raise L2Error(f"mooncake: setup with master {self.master} failed (rc {rc})")
        return store

    async def connect(self) -> None:
        await self.close()
        self._store = await self._call(self._setup)

    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        if self._store is None:
            raise L2Error("mooncake: not connected")
        values = await self._call(self._store.get_batch, [k.hex() for k in keys])
        return [v if v else None for v in values]

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        if self._store is None:
            raise L2Error("mooncake: not connected")
        rc = await self._call(
            self._store.upsert_batch, [k.hex() for k, _ in items], [v for _, v in items]
        )
        if rc != 0:
            raise L2Error(f"mooncake: batch write failed (rc {rc})", unavailable=False)

    async def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            await self._call(store.close)

    async def shutdown(self) -> None:
        await self.close()
        self._thread.shutdown(wait=False)
