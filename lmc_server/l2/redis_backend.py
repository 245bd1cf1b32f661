"""The Redis / Valkey adapter: redis-py's asyncio client, pipelined.

Reads are ``MGET`` (one command per batch), writes one pipeline of ``SET`` per batch
(``transaction=False``: no MULTI/EXEC, the writes are independent). redis-py's own
retries are turned off: a failed call surfaces at once as :class:`L2Error` and the tier
decides (degraded state, reconnect with backoff), so no request path ever waits on a
retry loop. ``rediss://`` (TLS) is redis-py's: certificate options go in the URL query
(``?ssl_ca_certs=/path/ca.pem``), see docs/l2.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lmc_server.l2.backend import L2Backend, L2Error

#: Keys per MGET and SETs per pipeline: bounds one round trip's memory on both ends.
GET_BATCH_KEYS = 64
PUT_BATCH_KEYS = 64


def _error(op: str, e: BaseException) -> L2Error:
    unavailable = isinstance(e, RedisConnectionError | RedisTimeoutError | OSError
                             | TimeoutError)
    return L2Error(f"redis {op}: {type(e).__name__}: {e}", unavailable=unavailable)


class RedisBackend(L2Backend):
    name = "redis"

    def __init__(self, url: str, password: str | None = None, timeout_s: float = 2.0) -> None:
        scheme, rest = url.split("://", 1)
        scheme = {"valkey": "redis", "valkeys": "rediss"}.get(scheme.lower(), scheme.lower())
        self.url = f"{scheme}://{rest}"
        self.password = password
        self.timeout_s = timeout_s
        self._client: Any = None

    def _make(self) -> Any:
        return aioredis.Redis.from_url(
            self.url, password=self.password, socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False, health_check_interval=0, decode_responses=False,
            max_connections=8)

    async def connect(self) -> None:
        await self.close()
        self._client = self._make()
        try:
            await self._client.ping()
        except (RedisError, OSError, TimeoutError) as e:
            raise _error("connect", e) from None

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if self._client is None:
            raise L2Error("redis: not connected")
        out: list[bytes | None] = []
        try:
            for i in range(0, len(keys), GET_BATCH_KEYS):
                out.extend(await self._client.mget(list(keys[i:i + GET_BATCH_KEYS])))
        except (RedisError, OSError, TimeoutError) as e:
            raise _error("get", e) from None
        return out

    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if self._client is None:
            raise L2Error("redis: not connected")
        try:
            for i in range(0, len(items), PUT_BATCH_KEYS):
                async with self._client.pipeline(transaction=False) as pipe:
                    for key, value in items[i:i + PUT_BATCH_KEYS]:
                        pipe.set(key, value)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            raise _error("set", e) from None

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except (RedisError, OSError, TimeoutError):
                pass
