"""The tiers below L1: a local disk directory and L2, KV objects shared across hosts on
an existing distributed store.

Layered beside ``transfer``: a tier reads and fills L1 slots through the index and the
pool, and talks to its store through an :class:`~lmc_server.tiers.backend.L2Backend`
adapter. The chain of tiers, the write-behind, the prefetch and the codec are here;
the disk tier is ``disk/``, the Redis/Valkey adapters (one node, a cluster) are
``redis/``, Mooncake Store is ``mooncake_backend``. The cache core knows nothing of
them. The flags keep the product's names (``--l2``, ``--disk-dir``).
"""
