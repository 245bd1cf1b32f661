"""Command line: ``lmcache server | ping | stats | bench``. Builds configs, nothing else."""
