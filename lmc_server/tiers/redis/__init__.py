"""The Redis/Valkey adapters of the L2 tier (``--l2 redis://...``, ``redis+cluster://...``).

``backend`` (one node), ``cluster`` (a Redis/Valkey Cluster: the same data path per
node, routed by redis-py's slot map), ``reads`` (values read straight into reserved L1
slots over several connections) and ``resp`` (the RESP reader those reads parse with).
The third-party client is imported as ``redis`` (absolute imports): this package's name
does not shadow it.
"""
