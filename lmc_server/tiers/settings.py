"""Every tier's settings as one group, and what the tiers are built with.

The groups are declared beside their checks (:class:`~lmc_server.tiers.checks.L2Settings`,
:class:`~lmc_server.tiers.disk.config.DiskSettings`); the server's ``Config`` is made of
:class:`TierSettings`. This module imports neither numpy nor the tiers' code, so the
configuration (and ``lmcache --help``) loads without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lmc_server.tiers.checks import L2Settings
from lmc_server.tiers.disk.config import DiskSettings


@dataclass
class TierSettings(DiskSettings, L2Settings):
    """Every tier's settings: the L2 group, then the disk group (the order of ``--help``;
    a dataclass lists its last base's fields first). ``Config`` is one."""


@dataclass(frozen=True)
class TierInputs:
    """What the tiers are built with: their settings, the chunk size in tokens (the unit
    of an object's key) and the L1 pool's bytes (the write pins' budget is a fraction)."""

    settings: TierSettings
    chunk_tokens: int
    l1_pool_bytes: int


class TierConfig(Protocol):
    """The server's configuration as ``l2.setup.make_chain`` reads it."""

    def tier_inputs(self) -> TierInputs: ...
