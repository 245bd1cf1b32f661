"""The L2 tier's settings and their checks (called by :meth:`Config.check`).

The settings are declared here (:class:`L2Settings`) and the server's ``Config`` is made
of them, so ``l2`` imports nothing above it: ``config`` builds on this group and calls
down into these checks, not the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmc_server.declare import setting
from lmc_server.tiers.url import L2ConfigError, parse_l2_url, read_password

#: Every tier below L1 (the disk tier's too) reads these, so one of the two must be set.
TIERS = ("l2_url", "disk_dir")


@dataclass
class L2Settings:
    """The L2 tier's settings, declared here, beside the code that reads them; the
    server's :class:`~lmc_server.config.Config` is made of this group (and of
    :class:`~lmc_server.tiers.disk.config.DiskSettings`), so the flags, variables, TOML keys
    and range checks follow from these fields. The queue, prefetch and timeout settings
    are the disk tier's too. Field order is the order of ``--help``."""

    l2_url: str = setting(  # never carries a password (docs/l2.md)
        "",
        "L2 tier shared across hosts: redis://HOST:PORT/DB (rediss:// for TLS, "
        "valkey:// too) or mooncake://MASTER:PORT. The password comes from "
        "LMCACHE_L2_PASSWORD or --l2-password-file, never the URL. See docs/l2.md.",
        flag="--l2",
        metavar="URL",
    )
    l2_password_file: str = setting(
        "", "File whose first line is the L2 password.", needs=("l2_url",)
    )
    l2_write_queue_objects: int = setting(
        4096,
        "Objects waiting to be written to L2; past this, writes are dropped (counted).",
        low=1,
        high=1 << 24,
        needs=TIERS,
    )
    l2_prefetch_max_chunks: int = setting(
        256,
        "Chunks after an L1 hit that one lookup asks L2 for.",
        low=1,
        high=16384,
        needs=TIERS,
    )
    l2_timeout_s: float = setting(
        2.0, "L2 connect and call timeout.", low=0.05, high=60, needs=TIERS
    )
    l2_connections: int = setting(
        8,
        "Redis connections for reads, and as many for writes; a batch is split across them.",
        low=1,
        high=16,
        needs=("l2_url",),
    )


def check_l2_config(settings: L2Settings, backend: str) -> None:
    """Raise :class:`L2ConfigError` naming the first unusable L2 setting; ``backend`` is
    the server's transfer engine (``--backend``). The ranges of the numeric settings are
    declared with the fields and checked before this runs."""
    parse_l2_url(settings.l2_url)
    read_password(settings.l2_password_file)
    if backend == "null":
        raise L2ConfigError(
            "--l2 needs pool memory to read objects from, and the null "
            "backend keeps none; run with --backend cpu or cuda"
        )
