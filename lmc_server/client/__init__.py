"""Client library used by engines, tests and benchmarks: sync and asyncio flavours.

    from lmc_server.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        reg = c.register(model=..., kv_dtype=..., arch="sm90", groups=..., buffers=...)
        hit = c.lookup(reg, digests)

Endpoints from a host and a port (IPv4, IPv6 with or without brackets, or a name):
``tcp_endpoint("::1", 5555) == "tcp://[::1]:5555"``; the sockets speak IPv6.
"""

from lmc_server.client.core import ChunkResult, CurveKeys, Registration, ServerError
from lmc_server.client.digests import chunk_digests, hash_chain
from lmc_server.client.sync import Client
from lmc_server.net import tcp_endpoint

__all__ = [
    "ChunkResult",
    "Client",
    "CurveKeys",
    "Registration",
    "ServerError",
    "chunk_digests",
    "hash_chain",
    "tcp_endpoint",
]
