"""`lmcache bench ranks`: TP ranks or DP engines on one server, one process per rank."""
