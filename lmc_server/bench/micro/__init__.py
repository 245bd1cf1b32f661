"""Micro-benchmarks of single pieces (index, eviction policies, disk writes, client cost).

Each runs as ``python -m lmc_server.bench.micro.<name>``; none is an ``lmcache bench``
command, none starts a server unless it says so.
"""
