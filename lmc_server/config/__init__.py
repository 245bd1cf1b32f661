"""Server configuration: values and checks, nothing else.

Precedence (highest first): command-line flags, ``LMCACHE_*`` environment variables,
the TOML file given with ``--config``, the defaults. The CLI resolves the first three
with click from the declarations of :class:`Config` (``settings.py``, through
``lmc_server/declare.py``; the tiers' groups are declared in ``lmc_server/tiers/``) and of
the client commands' :class:`ClientSettings` (``client.py``); this package defines the
fields, their defaults and ranges, the checks
that relate settings or need the machine (memory), and loads TOML files strictly
(unknown keys refused, ``files.py``).
"""

from lmc_server.config.client import ClientSettings
from lmc_server.config.files import (
    CLIENT_KEYS,
    CONFIG_KEYS,
    FLAG_NAMES,
    load_client_toml,
    load_toml,
)
from lmc_server.config.settings import (
    BACKENDS,
    CUDA_COPY_MODES,
    GIB,
    LOG_FORMATS,
    LOG_LEVELS,
    METRICS_PORT,
    MIB,
    SYSTEM_RESERVE_BYTES,
    Config,
    ServerSettings,
    default_l1_size_gb,
    gib_text,
    physical_memory_bytes,
)
from lmc_server.declare import ConfigError, Declared, declarations

__all__ = [
    "BACKENDS",
    "CLIENT_KEYS",
    "CONFIG_KEYS",
    "CUDA_COPY_MODES",
    "ClientSettings",
    "FLAG_NAMES",
    "GIB",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "METRICS_PORT",
    "MIB",
    "SYSTEM_RESERVE_BYTES",
    "ServerSettings",
    "Config",
    "ConfigError",
    "Declared",
    "declarations",
    "default_l1_size_gb",
    "gib_text",
    "load_client_toml",
    "load_toml",
    "physical_memory_bytes",
]
