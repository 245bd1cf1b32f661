"""Configuration checks of the disk tier (called by :meth:`Config.check`).

Like :mod:`lmc_server.l2.checks`, the settings come through a protocol, so ``l2``
imports nothing above it. The checks need the filesystem: the directory (or its nearest
existing parent) must be a directory, and the capacity must fit the filesystem it is on,
so a typo in ``--disk-size-gb`` is refused at start, not found when the disk fills.
"""

from __future__ import annotations

import os
from typing import Protocol

GIB = 1 << 30
FILE_SCHEME = "file://"


class DiskConfigError(ValueError):
    """The disk tier's settings are unusable; the message says why."""


class DiskSettings(Protocol):
    """The server settings the disk tier uses (a :class:`~lmc_server.config.Config`)."""

    @property
    def backend(self) -> str: ...
    @property
    def disk_dir(self) -> str: ...
    @property
    def disk_size_gb(self) -> float: ...


def disk_path(disk_dir: str) -> str:
    """The directory of ``--disk-dir`` (``PATH`` or ``file:///PATH``), absolute."""
    if disk_dir.startswith(FILE_SCHEME):
        disk_dir = disk_dir[len(FILE_SCHEME) :]
        if not disk_dir.startswith("/"):
            raise DiskConfigError(
                f"--disk-dir file://{disk_dir}: a file URL names an "
                f"absolute path (file:///var/cache/lmcache)"
            )
    return os.path.abspath(disk_dir)


def capacity_bytes(config: DiskSettings) -> int:
    return int(config.disk_size_gb * GIB)


def check_disk_config(config: DiskSettings) -> None:
    """Raise :class:`DiskConfigError` naming the first unusable disk-tier setting."""
    if not config.disk_dir:
        raise DiskConfigError("--disk-size-gb needs --disk-dir")
    if config.disk_size_gb <= 0:
        raise DiskConfigError(
            "--disk-dir needs --disk-size-gb (how much of the "
            "filesystem the tier may fill), e.g. --disk-size-gb 500"
        )
    if config.backend == "null":
        raise DiskConfigError(
            "--disk-dir needs pool memory to read objects from, and the "
            "null backend keeps none; run with --backend cpu or cuda"
        )
    path = disk_path(config.disk_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise DiskConfigError(f"--disk-dir {path} exists and is not a directory")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    total = st.f_blocks * st.f_frsize
    if capacity_bytes(config) > total:
        raise DiskConfigError(
            f"--disk-size-gb {config.disk_size_gb:g} is more than the "
            f"filesystem of {path} holds ({total / GIB:.1f} GiB)"
        )
