"""`lmcache bench l2`: the tiers below L1 (Redis, disk) and a trace replayed over both."""
