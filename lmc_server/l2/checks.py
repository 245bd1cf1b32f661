"""Configuration checks of the L2 settings (called by :meth:`Config.check`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmc_server.config import ConfigError
from lmc_server.l2.url import L2ConfigError, parse_l2_url, read_password

if TYPE_CHECKING:
    from lmc_server.config import Config


def check_l2_config(config: Config) -> None:
    """Raise :class:`ConfigError` naming the first unusable L2 setting."""
    try:
        parse_l2_url(config.l2_url)
        read_password(config.l2_password_file)
    except L2ConfigError as e:
        raise ConfigError(str(e)) from None
    if config.backend == "null":
        raise ConfigError("--l2 needs pool memory to read objects from, and the null "
                          "backend keeps none; run with --backend cpu or cuda")
    if not 1 <= config.l2_write_queue_objects <= 1 << 24:
        raise ConfigError("--l2-write-queue-objects must be in 1..16777216")
    if not 1 <= config.l2_prefetch_max_chunks <= 16384:
        raise ConfigError("--l2-prefetch-max-chunks must be in 1..16384")
    if not 0.05 <= config.l2_timeout_s <= 60:
        raise ConfigError("--l2-timeout-s must be in 0.05..60")
