"""The ``--l2`` URL: which store, where, and where its password comes from.

Credentials never come from the command line (``ps`` and shell history would show
them): a URL carrying a password is refused, and the password is read from the
``LMCACHE_L2_PASSWORD`` environment variable or from ``--l2-password-file`` (its
first line). A user name in the URL is allowed (it is not a secret; Redis ACLs).

No store client is imported here, so the configuration can be checked without one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Schemes and the adapter that serves them.
SCHEMES = {"redis": "redis", "rediss": "redis", "valkey": "redis", "valkeys": "redis",
           "mooncake": "mooncake"}
PASSWORD_ENV = "LMCACHE_L2_PASSWORD"


class L2ConfigError(ValueError):
    """The L2 URL or its credentials are unusable; the message says why."""


@dataclass(frozen=True)
class L2Target:
    """A parsed ``--l2`` URL (the password is never part of it)."""

    url: str
    kind: str  # "redis" or "mooncake"
    tls: bool

    @property
    def display(self) -> str:
        """The URL as logged and reported (it carries no secret)."""
        return self.url


def parse_l2_url(url: str) -> L2Target:
    """Check ``url`` and say which adapter serves it; raises :class:`L2ConfigError`."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a bad port
    except ValueError as e:
        raise L2ConfigError(f"--l2 {url!r} is not a URL: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise L2ConfigError(f"--l2 {url!r}: scheme {scheme or '(none)'!r} is not supported; "
                            f"use one of {', '.join(sorted(SCHEMES))}://host:port")
    if parts.password is not None:
        raise L2ConfigError(f"--l2: the URL carries a password; remove it and put it in "
                            f"the {PASSWORD_ENV} environment variable or a file named by "
                            f"--l2-password-file (the command line is visible to every "
                            f"user of this host)")
    if not parts.hostname:
        raise L2ConfigError(f"--l2 {url!r}: no host")
    return L2Target(url=url, kind=SCHEMES[scheme], tls=scheme in ("rediss", "valkeys"))


def read_password(password_file: str, environ: dict[str, str] | None = None) -> str | None:
    """The L2 password: the file's first line if a file is named, else the env var."""
    env = os.environ if environ is None else environ
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as f:
                line = f.readline().rstrip("\r\n")
        except OSError as e:
            raise L2ConfigError(f"cannot read --l2-password-file {password_file}: "
                                f"{e.strerror}") from None
        if not line:
            raise L2ConfigError(f"--l2-password-file {password_file} is empty")
        return line
    return env.get(PASSWORD_ENV) or None
