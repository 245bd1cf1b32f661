"""The optional packages of ``lmcache bench``, asked for by the extra that installs them.

The base install runs every benchmark with ``--no-progress`` and without ``--plot``
(and those with a disk tier or none, without Redis). A progress bar needs tqdm and a
plot matplotlib (``pip install 'lmc-server[bench]'``); a benchmark of the Redis tier
needs redis-py (``pip install 'lmc-server[l2]'``). :func:`require` checks before the
benchmark starts anything, so a missing package is a one-line usage error that names
the pip command, never a traceback from halfway through a run.
"""

from __future__ import annotations

import importlib

import click

#: module -> (extra that installs it, what it is for, what to do instead)
EXTRAS = {
    "tqdm": ("bench", "the progress bar", ", or pass --no-progress"),
    "matplotlib": ("bench", "--plot", ""),
    "redis": ("l2", "the Redis tier", ""),
}


def installed(module: str) -> bool:
    """Whether ``module`` imports (imported now: every caller goes on to use it)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def require(module: str, what: str = "") -> None:
    """Raise a :class:`click.UsageError` naming the pip extra unless ``module`` imports."""
    if installed(module):
        return
    extra, used_for, instead = EXTRAS[module]
    raise click.UsageError(
        f"{what or used_for} needs the {module} package: pip install 'lmc-server[{extra}]'{instead}"
    )
