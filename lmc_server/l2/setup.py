"""Build the L2 tier from the server's configuration (called once at startup)."""

from __future__ import annotations

from lmc_server.cache.index import L1Index
from lmc_server.l2.backend import L2Backend
from lmc_server.l2.checks import L2Settings
from lmc_server.l2.poolview import PoolView
from lmc_server.l2.tier import L2Tier
from lmc_server.l2.url import L2ConfigError, L2Target, parse_l2_url, read_password
from lmc_server.transfer.base import HostPool


def make_backend(target: L2Target, password: str | None, timeout_s: float) -> L2Backend:
    if target.kind == "redis":
        try:
            from lmc_server.l2.redis_backend import RedisBackend
        except ImportError:
            raise L2ConfigError("--l2 redis://: the redis package is not installed "
                                "(pip install 'lmc-server[l2]')") from None
        return RedisBackend(target.url, password, timeout_s)
    from lmc_server.l2.mooncake_backend import MooncakeBackend

    return MooncakeBackend(target.url, timeout_s)


def make_tier(config: L2Settings, index: L1Index, pool: HostPool, engine_name: str) -> L2Tier:
    """The tier for ``config.l2_url``; raises ``ValueError``/``RuntimeError`` if unusable
    (the server then refuses to start, naming the problem)."""
    target = parse_l2_url(config.l2_url)
    backend = make_backend(target, read_password(config.l2_password_file), config.l2_timeout_s)
    view = PoolView(pool, engine_name)  # after what may fail: a view holds the pool open
    return L2Tier(backend, target.display, index, view, config.chunk_size,
                  config.l2_write_queue_objects, config.l2_prefetch_max_chunks,
                  config.l2_timeout_s)
