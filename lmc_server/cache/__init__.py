"""The cache core: geometry, layout, keys, retention, pool, allocation, eviction, index.

Pure Python and numpy (msgspec for the geometry types), synchronous, no I/O: every
function here can be unit-tested without a socket, a process or a GPU. The server owns
one :class:`~lmc_server.cache.index.L1Index` and calls it from its event-loop thread
only, so nothing here takes a lock.

Modules, bottom up: ``geometry`` (group specs and their rules, ``blocks_per_chunk``),
``overlap``, ``keys`` (``DIGEST_BYTES``, namespace + digest + salt -> key), ``status``,
``counters``, ``eviction*`` (policies), ``pool`` (slabs, partitions, slot states),
``retention`` (one class per section kind: full, window), ``layout`` (object groups and
copy plans), ``view`` (the hit rule over a registration), ``allocator`` (free slots,
slab donation between partitions, eviction), ``leases``, ``store`` (reservation),
``retrieve`` (pinning), and ``index``, the facade the server, the L2 tier and the
tests drive.
"""
