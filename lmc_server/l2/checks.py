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
    @property
    def l1_size_bytes(self) -> int: ...


def check_l2_config(config: L2Settings) -> None:
    """Raise :class:`L2ConfigError` naming the first unusable L2 setting. The ranges of
    the numeric settings are declared with the fields and checked before this runs."""
    parse_l2_url(config.l2_url)
    read_password(config.l2_password_file)
    if config.backend == "null":
        raise L2ConfigError(
            "--l2 needs pool memory to read objects from, and the null "
            "backend keeps none; run with --backend cpu or cuda"
        )
