"""``python -m lmc_server.bench``: the benchmark group without the ``lmcache`` entry point."""

from lmc_server.bench.cli import bench

if __name__ == "__main__":
    bench(prog_name="python -m lmc_server.bench")
