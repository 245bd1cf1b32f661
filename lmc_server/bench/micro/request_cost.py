"""Client-side cost of one request, without the network: microseconds per call.

Each client's ``_roundtrip`` (the transport's send-and-wait) is replaced by encoding the
request and decoding a canned reply, so what is timed is everything else of the request
path: building the message (block ids included), the re-hello check, reading the reply
into the caller's value. Best of 7 runs of 20,000 calls each, for the blocking and the
asyncio client. Compare two trees back to back on one machine:

    cd /tmp && PYTHONPATH=/path/to/tree python -m lmc_server.bench.micro.request_cost

(run outside the checkout, so that the current directory does not shadow PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from lmc_server.client.aio import AsyncClient
from lmc_server.client.core import Registration
from lmc_server.client.digests import hash_chain
from lmc_server.client.sync import Client
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.testing.presets import simple_model

CALLS, REPEATS = 20000, 7
GEO = simple_model(layers=1, bytes_per_token=16)
REG = Registration(
    b"R" * 16,
    "ns",
    256,
    False,
    [m.ObjectGroupInfo(name="kv", object_bytes=4096, groups=["full"])],
    list(GEO.groups),
)
DIGEST = hash_chain([b"x"])
IDS = {"full": np.arange(16, dtype=np.int32)}


def reply_bytes(msg: Any) -> bytes:
    if isinstance(msg, m.Lookup):
        return encode(m.LookupResult(req_id=msg.req_id, hit_chunks=1))
    cls = m.StoreResult if isinstance(msg, m.Store) else m.RetrieveResult
    return encode(cls(req_id=msg.req_id, statuses=[b"\x00"]))


def fake_roundtrip(msg: Any, timeout_s: float | None = None) -> m.Reply:
    encode(msg)
    return decode_reply(reply_bytes(msg))


async def fake_aroundtrip(msg: Any) -> m.Reply:
    return fake_roundtrip(msg)


def best_us(run: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
    return round(min(times), 2)


async def best_us_async(make: Callable[[], Awaitable[Any]]) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            await make()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
    return round(min(times), 2)


def main() -> None:
    out: dict[str, float] = {}
    c = Client("tcp://127.0.0.1:9", hello=False)  # never connects: nothing is sent
    c._roundtrip = fake_roundtrip  # type: ignore[method-assign]
    out["sync lookup"] = best_us(
        lambda: [c.lookup(REG, DIGEST, lease=False) for _ in range(CALLS)] and None
    )
    out["sync store"] = best_us(lambda: [c.store(REG, DIGEST, IDS) for _ in range(CALLS)] and None)
    out["sync retrieve"] = best_us(
        lambda: [c.retrieve(REG, DIGEST, IDS) for _ in range(CALLS)] and None
    )
    c.close()

    async def run_async() -> None:
        a = AsyncClient("tcp://127.0.0.1:9")
        a._roundtrip = fake_aroundtrip  # type: ignore[method-assign]
        out["aio lookup"] = await best_us_async(lambda: a.lookup(REG, DIGEST, lease=False))
        out["aio store"] = await best_us_async(lambda: a.store(REG, DIGEST, IDS))
        out["aio retrieve"] = await best_us_async(lambda: a.retrieve(REG, DIGEST, IDS))
        await a.close()

    asyncio.run(run_async())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
