"""Client library used by engines, tests and benchmarks: sync and asyncio flavours.

    from lmc_server.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        reg = c.register(model=..., kv_dtype=..., arch="sm90", groups=..., buffers=...)
        hit = c.lookup(reg, digests)

A registration declares the worker's KV cache: its engine groups (:class:`GroupSpec`,
each listing where its layers' pages are, :class:`LayerSpec`) and the buffers holding
them, which the server maps once and then copies pages out of and into:

* host memory, for the server's cpu backend: allocate the KV cache in a
  :class:`ShmSegment` (POSIX shared memory; ``segment.array`` is its bytes, a numpy
  view the engine reads and writes) and pass ``segment.spec``;
* GPU memory, for the cuda backend: ``lmc_server.client.cuda.export_tensor(t)`` of each
  torch CUDA tensor holding KV (imports torch, so it is not imported here).

Endpoints from a host and a port (IPv4, IPv6 with or without brackets, or a name):
``tcp_endpoint("::1", 5555) == "tcp://[::1]:5555"``; the sockets speak IPv6.
``lmc_server.client.aio.AsyncClient`` is the same API for asyncio.

Errors: a refusal is a :class:`ServerError` (its ``code`` names the reason), a wait
that gets no answer an :class:`LmcTimeoutError` (a ``TimeoutError``), a hand-over the
server refuses an :class:`LmcConnectionError` (a ``ConnectionError``); all are
:class:`LmcError`, so ``except LmcError`` handles every error the client raises for the
server's sake.
"""

from lmc_server.cache.geometry import GroupSpec, LayerSpec
from lmc_server.client.core import ChunkResult, CurveKeys, Registration, ServerError
from lmc_server.client.digests import chunk_digests, hash_chain
from lmc_server.client.shm import ShmSegment
from lmc_server.client.sync import Client
from lmc_server.errors import LmcConnectionError, LmcError, LmcTimeoutError
from lmc_server.net import tcp_endpoint

__all__ = [
    "ChunkResult",
    "Client",
    "CurveKeys",
    "GroupSpec",
    "LayerSpec",
    "LmcConnectionError",
    "LmcError",
    "LmcTimeoutError",
    "Registration",
    "ServerError",
    "ShmSegment",
    "chunk_digests",
    "hash_chain",
    "tcp_endpoint",
]
