"""Client library used by engines, tests and benchmarks: sync and asyncio flavours.

    from lmc_server.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        reg = c.register(model=..., kv_dtype=..., arch="sm90", groups=..., buffers=...)
        hit = c.lookup(reg, digests)
"""

from lmc_server.client.core import ChunkResult, CurveKeys, Registration, ServerError
from lmc_server.client.digests import chunk_digests, hash_chain
from lmc_server.client.sync import Client

__all__ = ["ChunkResult", "Client", "CurveKeys", "Registration", "ServerError", "chunk_digests",
           "hash_chain"]
