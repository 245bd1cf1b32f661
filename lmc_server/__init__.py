"""lmc-server: a standalone KV-cache server for vLLM workers.

The package is layered; imports point down only (docs/architecture.md; the table in
tests/project/test_layering.py is enforced):

    cli -> bench -> testing -> integration -> client -> protocol -> cache (core)
    cli -> server -> config -> l2 -> transfer -> cache ; server -> metrics, protocol

``lmc_server.cache`` is pure synchronous Python (numpy and msgspec) and never imports
zmq, torch or cupy, so the core is testable without sockets or a GPU.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 2
