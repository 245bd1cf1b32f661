"""The ``--l2`` URL: which store, where, and where its password comes from.

Credentials never come from the command line (``ps`` and shell history would show
them), nor from the TOML file or ``LMCACHE_L2`` (all three end up in the same URL): a
URL carrying one is refused, and the password is read from the ``LMCACHE_L2_PASSWORD``
environment variable or from ``--l2-password-file`` (its first line). A user name before
the host is allowed (it is not a secret; Redis ACLs).

What carries a credential: the password of the URL's userinfo (``user:pw@``), and any
query parameter that names one. redis-py hands *every* query parameter to its connection
as a keyword argument (``redis.connection.parse_url``), so ``?password=`` and
``?username=`` authenticate and ``?ssl_password=`` unlocks a key file; the names
refused are those and anything else that looks like a secret (:func:`_secret_name`),
matched after the same percent-decoding redis-py applies. A query value that is itself
a URL with a password (Mooncake's ``metadata=``) is refused too.

Invariant, in depth: a URL is shown (logs, stats, /healthz, error messages) only
through :func:`redact_url`, which never raises and masks every such part, so a form
this check missed is still never printed.

No store client is imported here, so the configuration can be checked without one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote_plus, urlsplit

from lmc_server.errors import LmcError

#: Schemes and the adapter that serves them.
SCHEMES = {
    "redis": "redis",
    "rediss": "redis",
    "valkey": "redis",
    "valkeys": "redis",
    "redis+cluster": "redis-cluster",
    "rediss+cluster": "redis-cluster",
    "valkey+cluster": "redis-cluster",
    "valkeys+cluster": "redis-cluster",
    "mooncake": "mooncake",
}
PASSWORD_ENV = "LMCACHE_L2_PASSWORD"
#: Query parameter names (lower case) that carry who the client is to the store.
_IDENTITY_NAMES = frozenset({"username", "user"})
#: Parts of a query parameter name (lower case) that mean it carries a secret:
#: ``password``, ``ssl_password``, ``passwd``, ``passphrase``, ``credential_provider``,
#: ``auth``, ``token``, ``secret``...
_SECRET_PARTS = ("pass", "secret", "token", "auth", "credential")
#: What a masked part is shown as.
MASK = "***"
_WHERE = (
    f"the password goes in the {PASSWORD_ENV} environment variable (the unit's "
    f"environment file) or in a file named by --l2-password-file, a user name "
    f"before the host (redis://USER@HOST:PORT/DB); the command line, the config "
    f"file and the environment of a unit are readable by others"
)


class L2ConfigError(LmcError, ValueError):
    """The L2 URL or its credentials are unusable; the message says why."""


@dataclass(frozen=True)
class L2Target:
    """A parsed ``--l2`` URL (the password is never part of it)."""

    url: str
    kind: str  # "redis" or "mooncake"
    tls: bool

    @property
    def display(self) -> str:
        """The URL as logged and reported (:func:`redact_url`)."""
        return redact_url(self.url)


def _secret_name(name: str) -> bool:
    """True if a query parameter named ``name`` (decoded) carries a credential."""
    n = name.strip().lower()
    return n in _IDENTITY_NAMES or any(part in n for part in _SECRET_PARTS)


def _has_password(value: str) -> bool:
    """True if ``value`` is a URL whose userinfo holds a password."""
    if "://" not in value or "@" not in value:
        return False
    try:
        return urlsplit(value).password is not None
    except ValueError:
        return True  # unparseable, with an ``@``: assume the worst


def _redact_param(piece: str) -> str:
    name, eq, value = piece.partition("=")
    if _secret_name(unquote_plus(name)) or "@" in unquote_plus(value):
        return f"{name}={MASK}"
    return piece


def redact_url(url: str) -> str:
    """``url`` as it may be shown: the userinfo's password, credential query
    parameters, query values holding an ``@`` and a port that is not a number (the tail
    of a password holding ``#`` or ``/``, as the URL parser splits it) are masked, the
    fragment is dropped. Never raises; an unparseable URL shows as its scheme only."""
    scheme = url.partition("://")[0] if "://" in url else ""
    try:
        parts = urlsplit(url)
    except ValueError:
        return f"{scheme}://{MASK}" if scheme else MASK
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0] + (f":{MASK}" if ":" in userinfo else "")
    if not hostport.endswith("]"):
        host, colon, port = hostport.rpartition(":")
        if colon and not port.isdigit():
            hostport = f"{host}:{MASK}"
    query = "&".join(_redact_param(p) for p in parts.query.split("&")) if parts.query else ""
    return f"{parts.scheme}://{user}{at}{hostport}{parts.path}" + (f"?{query}" if query else "")


def credential_in(url: str) -> str | None:
    """Where ``url`` carries a credential (``"the password before the host"``, ``"query
    parameter 'password'"``), or None. ``url`` must split (:func:`urlsplit`)."""
    parts = urlsplit(url)
    if parts.password is not None:
        return "a password before the host (user:password@)"
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if _secret_name(name):
            return f"query parameter {name!r}"
        if _has_password(value):
            return f"a password in the URL of query parameter {name!r}"
    return None


def parse_l2_url(url: str) -> L2Target:
    """Check ``url`` and say which adapter serves it; raises :class:`L2ConfigError`."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        where = credential_in(url)
    except ValueError as e:
        raise L2ConfigError(f"--l2 {shown!r} is not a URL: {e}") from None
    if where is not None:  # before any other check: no message may echo the secret
        raise L2ConfigError(
            f"--l2 {shown!r}: the URL carries a credential ({where}); remove it: {_WHERE}"
        )
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise L2ConfigError(
            f"--l2 {shown!r}: scheme {scheme or '(none)'!r} is not "
            f"supported; use one of {', '.join(sorted(SCHEMES))}://host:port"
        )
    if SCHEMES[scheme] == "redis-cluster":  # HOST:PORT[,HOST:PORT...]
        for node in parts.netloc.rpartition("@")[2].split(","):
            host, colon, port = node.strip().rpartition(":")
            if not host or not colon or not port.isdigit() or not 0 < int(port) < 65536:
                raise L2ConfigError(
                    f"--l2 {shown!r}: a cluster URL names its nodes as "
                    f"HOST:PORT[,HOST:PORT...] ({scheme}://10.0.0.1:7000,10.0.0.2:7000)"
                )
        if parts.path.strip("/") not in ("", "0"):
            raise L2ConfigError(f"--l2 {shown!r}: a cluster has database 0 only (no /DB)")
    else:
        try:
            _ = parts.port  # raises on a bad port (its message would echo the text)
        except ValueError:
            raise L2ConfigError(f"--l2 {shown!r}: the port is not a number in 0..65535") from None
        if not parts.hostname:
            raise L2ConfigError(f"--l2 {shown!r}: no host")
    return L2Target(
        url=url, kind=SCHEMES[scheme], tls=scheme.partition("+")[0] in ("rediss", "valkeys")
    )


def read_password(password_file: str, environ: dict[str, str] | None = None) -> str | None:
    """The L2 password: the file's first line if a file is named, else the env var."""
    env = os.environ if environ is None else environ
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as f:
                line = f.readline().rstrip("\r\n")
        except OSError as e:
            raise L2ConfigError(
                f"cannot read --l2-password-file {password_file}: {e.strerror}"
            ) from None
        if not line:
            raise L2ConfigError(f"--l2-password-file {password_file} is empty")
        return line
    return env.get(PASSWORD_ENV) or None
