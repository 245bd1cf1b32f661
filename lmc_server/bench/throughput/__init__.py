"""`lmcache bench throughput`: store/retrieve GB/s through a real server vs a raw copy."""
