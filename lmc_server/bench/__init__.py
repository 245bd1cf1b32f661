"""``lmcache bench``: how fast the server is on this machine, against its own limits.

Seven subcommands, each measuring a real server process next to a baseline taken in the
same run (so ratios, not absolute numbers, are what carries across machines):
``throughput`` (store/retrieve bandwidth vs a raw copy of the same bytes), ``latency``
(round trips vs a plain pyzmq echo), ``startup`` (time to ping and to a ready pool),
``replay`` (token hit ratio on a request trace vs the infinite-cache and Belady bounds),
``ranks`` (tensor-parallel ranks with replicated KV vs all GPUs' raw copies at once),
``l2`` (the tiers below L1 vs plain clients of the same store) and ``interference`` (the
server beside an engine computing on the same GPU). A family of several modules is a
subpackage (``throughput/``, ``ranks/``, ``interference/``, ``l2/``, ``traces/``), the
baselines are in ``baselines/``, micro-benchmarks of one piece in ``micro/``
(docs/architecture.md, "The benchmarks").
"""
