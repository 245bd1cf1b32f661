"""What the benchmarks measure the server against: a pyzmq echo and raw copies."""
