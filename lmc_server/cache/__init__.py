"""The cache core: geometry, layout, keys, retention, pool, allocation, eviction, index.

Pure Python and numpy (msgspec for the geometry types), synchronous, no I/O: every
function here can be unit-tested without a socket, a process or a GPU. The server owns
one :class:`~lmc_server.cache.index.L1Index` and calls it from its event-loop thread
only, so nothing here takes a lock.

Modules, bottom up: ``geometry`` (group specs and their rules, ``blocks_per_chunk``),
``overlap``, ``keys`` (``DIGEST_BYTES``, namespace + digest + salt -> key), ``status``,
``counters``, ``eviction`` (the policies, a subpackage), ``slabs`` (where slots lie in a slab),
``slab_pool`` (which slabs are ready, who owns each), ``watch`` (the watcher protocol),
``pool`` (partitions, slot states), ``retention`` (one class per
section kind: full, window), ``layout`` (object groups and copy plans), ``view`` (the
hit rule over a registration), ``allocator`` (free slots, slab donation between
partitions, eviction), ``reservation`` (the one reservation type, committed last chunk
first), ``leases``, ``store`` (a store's reservation), ``retrieve`` (pinning),
``usage`` (what each partition holds), and ``index``, the one door the server, the L2
tiers and the tests go through; it builds the slab pool and owns it. ``slab_pool``,
``pool``, ``allocator``, ``reservation``, ``store``, ``retrieve`` and ``leases`` are
imported inside this package only (``tests/project/test_layering.py``).
"""
