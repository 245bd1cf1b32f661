"""The cache core: geometry, object-group layout, keys, pool, eviction, L1 index.

Pure Python and numpy, synchronous, no I/O: every function here can be unit-tested
without a socket, a process or a GPU. The server owns one :class:`L1Index` and calls
it from its event-loop thread only, so nothing here takes a lock.
"""
