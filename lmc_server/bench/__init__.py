"""``lmcache bench``: how fast the server is on this machine, against its own limits.

Five subcommands, each measuring a real server process next to a baseline taken in the
same run (so ratios, not absolute numbers, are what carries across machines):
``throughput`` (store/retrieve bandwidth vs a raw copy of the same bytes), ``latency``
(round trips vs a plain pyzmq echo), ``startup`` (time to ping and to a ready pool),
``replay`` (token hit ratio on a request trace vs the infinite-cache and Belady bounds)
and ``ranks`` (tensor-parallel ranks with replicated KV vs all GPUs' raw copies at once).
"""
