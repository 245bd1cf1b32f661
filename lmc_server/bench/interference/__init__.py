"""`lmcache bench interference`: the server beside an engine computing on the same GPU."""
