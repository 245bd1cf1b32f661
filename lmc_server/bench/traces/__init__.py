"""Request traces: the file format, generators, `lmcache bench replay`, bounds, tier models."""
