"""``python -m lmc_server`` is the same as the ``lmcache`` console script."""

from lmc_server.cli.main import main

if __name__ == "__main__":
    main()
