"""lmc-server: a standalone KV-cache server for vLLM workers.

The package is layered; imports point down only:

    cli -> server -> protocol -> cache (core) ; server -> transfer, metrics
    client -> protocol ; integration -> client

``lmc_server.cache`` is pure synchronous Python (numpy only) and never imports
zmq, torch or cupy, so the core is testable without sockets or a GPU.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 2
