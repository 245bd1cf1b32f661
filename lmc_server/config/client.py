"""The client commands' settings (``lmcache ping``, ``lmcache stats``), declared once.

Where the server is, they take the server's own settings (:func:`same_as`): the same
flags, ``LMCACHE_HOST``/``LMCACHE_PORT``, defaults and range, and the ``host`` and
``port`` of the server's TOML file, so the commands find the server a file or the
environment configures. Their own settings (the timeout, the client's CURVE pair) may
also come from the file's ``[client]`` table (``files.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmc_server.config.settings import ServerSettings
from lmc_server.declare import same_as, setting


@dataclass
class ClientSettings:
    """Every setting of the client commands, in the order of their ``--help``."""

    host: str = same_as(
        ServerSettings,
        "host",
        "Server address (IPv4, IPv6 with or without brackets, or a name).",
    )
    port: int = same_as(ServerSettings, "port", "Server port.")
    timeout_s: float = setting(
        2.0, "Seconds to wait for an answer.", low=0, low_open=True, env=False
    )
    curve_server_key_file: str = setting(
        "",
        "The server's public CURVE certificate (server.key); with a client certificate, "
        "talk CURVE.",
    )
    curve_client_secret_key_file: str = setting(
        "",
        "This client's CURVE certificate with its secret key (NAME.key_secret from "
        "'lmcache keygen --name NAME'; its NAME.key must be in the server's "
        "--curve-clients-dir).",
    )
