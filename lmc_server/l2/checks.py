"""Configuration checks of the L2 settings (called by :meth:`Config.check`).

The tier reads its settings through :class:`L2Settings`, the fields of
:class:`lmc_server.config.Config` it needs, so ``l2`` imports nothing above it:
``config`` calls down into these checks, not the other way round.
"""

from __future__ import annotations

from typing import Protocol

from lmc_server.l2.url import L2ConfigError, parse_l2_url, read_password


class L2Settings(Protocol):
    """The server settings the L2 tier uses (a :class:`~lmc_server.config.Config`)."""

    @property
    def backend(self) -> str: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def l2_url(self) -> str: ...
    @property
    def l2_password_file(self) -> str: ...
    @property
    def l2_write_queue_objects(self) -> int: ...
    @property
    def l2_prefetch_max_chunks(self) -> int: ...
    @property
    def l2_timeout_s(self) -> float: ...
    @property
    def l2_connections(self) -> int: ...


def check_l2_config(config: L2Settings) -> None:
    """Raise :class:`L2ConfigError` naming the first unusable L2 setting."""
    parse_l2_url(config.l2_url)
    read_password(config.l2_password_file)
    if config.backend == "null":
        raise L2ConfigError("--l2 needs pool memory to read objects from, and the null "
                            "backend keeps none; run with --backend cpu or cuda")
    if not 1 <= config.l2_write_queue_objects <= 1 << 24:
        raise L2ConfigError("--l2-write-queue-objects must be in 1..16777216")
    if not 1 <= config.l2_prefetch_max_chunks <= 16384:
        raise L2ConfigError("--l2-prefetch-max-chunks must be in 1..16384")
    if not 1 <= config.l2_connections <= 16:
        raise L2ConfigError("--l2-connections must be in 1..16")
    if not 0.05 <= config.l2_timeout_s <= 60:
        raise L2ConfigError("--l2-timeout-s must be in 0.05..60")
