"""The disk tier's settings and their checks (called by :meth:`Config.check`).

Like :mod:`lmc_server.tiers.checks`, the settings are declared here (:class:`DiskSettings`)
and the server's ``Config`` is made of them, so ``l2`` imports nothing above it. The
checks need the filesystem: the directory (or its nearest
existing parent) must be a directory, and the capacity must fit the filesystem it is on,
so a typo in ``--disk-size-gb`` is refused at start, not found when the disk fills.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from lmc_server.declare import setting
from lmc_server.errors import LmcError

GIB = 1 << 30
FILE_SCHEME = "file://"


class DiskConfigError(LmcError, ValueError):
    """The disk tier's settings are unusable; the message says why."""


@dataclass
class DiskSettings:
    """The disk tier's settings, declared here; the server's ``Config`` is made of this
    group (after :class:`~lmc_server.tiers.checks.L2Settings`, the order of ``--help``). The
    write queue, prefetch and timeout settings it shares with L2 are declared there."""

    disk_dir: str = setting(
        "",
        "Disk tier between L1 and L2: a directory on local NVMe or a shared filesystem "
        "(PATH or file:///PATH). Needs --disk-size-gb. See docs/l2.md.",
        metavar="PATH",
    )
    disk_size_gb: float = setting(
        0.0,
        "Bytes the disk tier may hold; the least recently used files go first.",
        low=0,
        high=1 << 20,
    )
    disk_optional: bool = setting(
        False,
        "Start even if --disk-dir cannot be used (not writable, read-only, not a "
        "directory): the disk tier starts degraded and retries; without it the server "
        "refuses to start, saying what to change.",
    )


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


def capacity_bytes(settings: DiskSettings) -> int:
    return int(settings.disk_size_gb * GIB)


def unusable(path: str) -> str | None:
    """Why the server cannot keep the disk tier in ``path`` (the path, the error and
    what to change), or None when it can. Leaves nothing behind: in an existing
    directory it creates, writes and removes a file; else it makes and removes a
    directory in the nearest existing parent (the tier makes the path at start)."""
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        if existing == path:
            step = "write a file in it"
            probe = os.path.join(path, f".lmcache-probe.{os.getpid()}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
            try:
                os.write(fd, b"\0")
            finally:
                os.close(fd)
                os.unlink(probe)
        else:
            step = f"create it (in {existing})"
            probe = os.path.join(existing, f".lmcache-probe.{os.getpid()}")
            os.mkdir(probe, 0o700)
            os.rmdir(probe)
    except OSError as e:
        return disk_error(path, step, e)
    return None


def disk_error(path: str, step: str, e: OSError) -> str:
    """``--disk-dir PATH: cannot STEP: ENAME (message) at WHERE; what to change``."""
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"--disk-dir {path}: cannot {step}: {code} ({e.strerror}); {_hint(path, e)}"


def _hint(path: str, e: OSError) -> str:
    who = _user()
    if e.errno in (errno.EACCES, errno.EPERM):
        if path.startswith(("/proc/", "/sys/")):
            return "that is a kernel filesystem: use a directory on a disk"
        return (
            f"the server runs as {who}: give it the directory (chown {who} {path}; "
            f"chmod 0750 {path}), or pick one it owns; under systemd, ProtectSystem=strict "
            f"leaves only the unit's StateDirectory/CacheDirectory and its "
            f"ReadWritePaths= writable: add ReadWritePaths={path} to the unit "
            f"(deploy/lmcache-server.service, docs/operations.md)"
        )
    if e.errno == errno.EROFS:
        return (
            f"the filesystem is read-only for the server: under systemd "
            f"(ProtectSystem=strict) add ReadWritePaths={path} to the unit "
            f"(deploy/lmcache-server.service), else remount it read-write"
        )
    if e.errno == errno.ENOTDIR:
        return "a part of the path is a file, not a directory: name another path"
    if e.errno == errno.ENOENT:
        return (
            "a part of the path cannot be made here (a kernel filesystem such as /proc, "
            "or a parent removed meanwhile): use a directory on a disk"
        )
    if e.errno == errno.ENOLCK:
        return (
            "the filesystem takes no POSIX locks (NFS mounted with nolock?): the servers "
            "sharing a directory count its bytes under one; mount it with locking"
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the filesystem (or the user's quota) is full: free space or use another"
    return "use a directory the server's user can write"


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return f"uid {os.geteuid()}"


def check_disk_config(settings: DiskSettings, backend: str) -> None:
    """Raise :class:`DiskConfigError` naming the first unusable disk-tier setting;
    ``backend`` is the server's transfer engine (``--backend``)."""
    if not settings.disk_dir:
        raise DiskConfigError("--disk-size-gb needs --disk-dir")
    if settings.disk_size_gb <= 0:
        raise DiskConfigError(
            "--disk-dir needs --disk-size-gb (how much of the "
            "filesystem the tier may fill), e.g. --disk-size-gb 500"
        )
    if backend == "null":
        raise DiskConfigError(
            "--disk-dir needs pool memory to read objects from, and the "
            "null backend keeps none; run with --backend cpu or cuda"
        )
    path = disk_path(settings.disk_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise DiskConfigError(f"--disk-dir {path} exists and is not a directory")
    problem = unusable(path)
    if problem is not None:
        if settings.disk_optional:
            return  # the tier starts degraded, says so and retries (--disk-optional)
        raise DiskConfigError(
            f"{problem}; or pass --disk-optional to start without the disk tier until "
            f"the directory can be used"
        )
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    total = st.f_blocks * st.f_frsize
    if capacity_bytes(settings) > total:
        raise DiskConfigError(
            f"--disk-size-gb {settings.disk_size_gb:g} is more than the "
            f"filesystem of {path} holds ({total / GIB:.1f} GiB)"
        )
