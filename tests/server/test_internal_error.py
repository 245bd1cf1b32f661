"""A bug in a handler is answered ``internal`` under the request's own id, so an asyncio
caller (which matches replies by id) sees the error at once instead of its timeout; the
server goes on serving."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from lmc_server.buffers import BufferSpec
from lmc_server.client import ServerError
from lmc_server.client.aio import AsyncClient
from lmc_server.testing.inprocess import run_server
from lmc_server.testing.kv import ShmKV
from lmc_server.testing.presets import simple_model
from lmc_server.transfer.base import BufferMapping
from lmc_server.transfer.null import NullEngine


class BrokenOpen(NullEngine):
    """An engine whose ``open`` fails with a bug (not a ``TransferError`` refusal)."""

    def open(self, buffers: Sequence[BufferSpec]) -> BufferMapping:
        raise RuntimeError("a bug in open")


def test_internal_error_reaches_the_asyncio_caller_under_its_request_id() -> None:
    async def main(endpoint: str) -> None:
        client = await AsyncClient.connect(endpoint, timeout_s=20)
        try:
            with ShmKV(simple_model(num_blocks=8, layers=2)) as kv:
                t0 = asyncio.get_running_loop().time()
                with pytest.raises(ServerError) as e:
                    await client.register(**kv.register_kwargs())
                assert e.value.code == "internal"
                assert asyncio.get_running_loop().time() - t0 < 10  # not the timeout
            assert (await client.ping()).ready is not None  # still serving
        finally:
            await client.close()

    with run_server(engine=BrokenOpen(), l1_size_gb=0.25) as ts:
        asyncio.run(main(ts.endpoint))
