"""The L2 tier: KV objects shared across hosts on an existing distributed store.

Layered beside ``transfer``: it reads and fills L1 slots through the index and the
pool, and talks to the store through an :class:`~lmc_server.l2.backend.L2Backend`
adapter (Redis/Valkey, Mooncake Store). The cache core knows nothing of it.
"""
