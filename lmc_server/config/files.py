"""The TOML settings file (``--config``): read strictly, keys checked against the
declarations (a field's name or its flag's, ``-`` or ``_``); values are left to the
command line's types, which check them as they check a flag's."""

from __future__ import annotations

import tomllib
from typing import Any

from lmc_server.config.client import ClientSettings
from lmc_server.config.settings import Config
from lmc_server.declare import ConfigError, declarations

CONFIG_KEYS = frozenset(d.name for d in declarations(Config))
#: Settings whose flag is not named like their field: the TOML file takes the flag's name
#: (``l2 = "redis://..."``, as ``--l2``) and the field's (``l2_url``, kept as an alias).
FLAG_NAMES = {d.key: d.name for d in declarations(Config) if d.key != d.name}


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file; keys are flag or field names (``-`` or ``_``), unknown
    refused, a setting named twice (``l2`` and ``l2_url``) refused.

    The file may hold the settings at top level or under a ``[server]`` table; a
    ``[client]`` table beside it (settings of ``lmcache ping`` and ``lmcache stats``, see
    :func:`load_client_toml`) is left to them.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    data = _server_settings(path, data)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = FLAG_NAMES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in CONFIG_KEYS:
            raise ConfigError(
                f"config file {path}: unknown setting {key!r}; known: "
                f"{', '.join(sorted(CONFIG_KEYS | set(FLAG_NAMES)))}"
            )
        if name in out:
            raise ConfigError(
                f"config file {path}: {key!r} names a setting given "
                f"already (as {name!r} or its flag's name)"
            )
        out[name] = value
    return out


#: The tables a settings file may hold; settings are scalars, so a table is never one.
TABLES = ("server", "client")


def _server_settings(path: str, data: dict[str, Any]) -> dict[str, Any]:
    """The server's settings of a parsed file: its ``[server]`` table, or its top level
    (less ``[client]``). A table of another name (``[clinet]``) is refused by name, and
    so is a file with settings both at top level and under ``[server]``."""
    tables = {k for k, v in data.items() if isinstance(v, dict)}
    unknown = sorted(tables - set(TABLES))
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown table [{unknown[0]}]; known tables: "
            f"{', '.join(f'[{t}]' for t in TABLES)} (or the server's settings at top level)"
        )
    if "server" in data and not isinstance(data["server"], dict):
        raise ConfigError(f"config file {path}: server must be a table ([server])")
    top = {k: v for k, v in data.items() if k not in tables}
    if "server" in tables:
        if top:
            raise ConfigError(
                f"config file {path}: settings both at top level ({', '.join(sorted(top))}) "
                f"and under [server]; put them all under [server]"
            )
        server: dict[str, Any] = data["server"]
        return server
    return top


#: Settings of the client commands (``ping``, ``stats``) in a ``[client]`` table.
CLIENT_KEYS = frozenset(d.name for d in declarations(ClientSettings))
#: Those that are the server's settings too, taken from its table first.
SERVER_KEYS = tuple(d.name for d in declarations(ClientSettings) if d.same_as is not None)


def load_client_toml(path: str) -> dict[str, Any]:
    """Settings for ``lmcache ping``/``stats`` from the server's TOML file.

    ``host`` and ``port`` come from the ``[server]`` table (or the top level), so the
    commands find the server the file configures; a ``[client]`` table adds or overrides
    ``host``, ``port``, ``timeout_s`` and the client's CURVE files (unknown keys refused).
    A server listening on every address (``::``, ``0.0.0.0``) is reached on loopback.
    """
    server = load_toml(path)
    out: dict[str, Any] = {k: server[k] for k in SERVER_KEYS if k in server}
    if out.get("host") in ("::", "[::]", "0.0.0.0", "*"):
        out["host"] = "::1" if ":" in str(out["host"]) else "127.0.0.1"
    with open(path, "rb") as f:
        client = tomllib.load(f).get("client", {})
    if not isinstance(client, dict):
        raise ConfigError(f"config file {path}: [client] must be a table")
    for key, value in client.items():
        name = key.replace("-", "_")
        if name not in CLIENT_KEYS:
            raise ConfigError(
                f"config file {path}: unknown [client] setting {key!r}; "
                f"known: {', '.join(sorted(CLIENT_KEYS))}"
            )
        out[name] = value
    return out
