"""Build the tiers below L1 from the server's configuration (called once at startup).

The tiers' settings are the groups declared in this package
(:class:`~lmc_server.tiers.settings.TierSettings`); what a tier is built with of the L1
server's own settings (its chunk size, its pool's bytes) comes as ``TierInputs``, which
the server's ``Config`` makes (``TierConfig``): ``l2`` names what it needs and imports
nothing above it.

Every tier reads the server's clock (``clock``): what a tier decides by time (how long
a known miss is remembered, how long it has been up or degraded) moves with a test's
fake clock as the rest of the server does.
"""

from __future__ import annotations

from collections.abc import Callable

from lmc_server.cache.index import L1Index
from lmc_server.tiers.backend import L2Backend
from lmc_server.tiers.chain import TierChain
from lmc_server.tiers.disk.backend import FileBackend
from lmc_server.tiers.disk.config import capacity_bytes, disk_path
from lmc_server.tiers.poolview import PoolView
from lmc_server.tiers.settings import TierConfig, TierInputs
from lmc_server.tiers.tier import L2Tier
from lmc_server.tiers.url import L2ConfigError, L2Target, parse_l2_url, read_password
from lmc_server.tiers.writer import WRITE_PIN_FRACTION
from lmc_server.transfer.base import HostPool


def make_backend(
    target: L2Target, password: str | None, timeout_s: float, connections: int = 1
) -> L2Backend:
    if target.kind == "redis-cluster":
        try:
            from lmc_server.tiers.redis.cluster import RedisClusterBackend
        except ImportError:
            raise L2ConfigError(
                "--l2 redis+cluster://: the redis package is not installed "
                "(pip install 'lmc-server[l2]')"
            ) from None
        return RedisClusterBackend(target.url, password, timeout_s, connections)
    if target.kind == "redis":
        try:
            from lmc_server.tiers.redis.backend import RedisBackend
        except ImportError:
            raise L2ConfigError(
                "--l2 redis://: the redis package is not installed (pip install 'lmc-server[l2]')"
            ) from None
        return RedisBackend(target.url, password, timeout_s, connections)
    from lmc_server.tiers.mooncake_backend import MooncakeBackend

    return MooncakeBackend(target.url, timeout_s)


def make_tier(
    inputs: TierInputs, index: L1Index, pool: HostPool, engine_name: str, clock: Callable[[], float]
) -> L2Tier:
    """The tier for ``l2_url``; raises ``ValueError``/``RuntimeError`` if unusable (the
    server then refuses to start, naming the problem)."""
    s = inputs.settings
    target = parse_l2_url(s.l2_url)
    backend = make_backend(
        target, read_password(s.l2_password_file), s.l2_timeout_s, s.l2_connections
    )
    view = PoolView(pool, engine_name)  # after what may fail: a view holds the pool open
    return L2Tier(
        backend,
        target.display,
        index,
        view,
        inputs.chunk_tokens,
        s.l2_write_queue_objects,
        s.l2_prefetch_max_chunks,
        s.l2_timeout_s,
        clock,
        pin_budget_bytes=_pin_budget(inputs),
    )


def _pin_budget(inputs: TierInputs) -> int:
    return int(inputs.l1_pool_bytes * WRITE_PIN_FRACTION)


def make_disk_tier(
    inputs: TierInputs, index: L1Index, view: PoolView, clock: Callable[[], float]
) -> L2Tier:
    s = inputs.settings
    path = disk_path(s.disk_dir)
    backend = FileBackend(path, capacity_bytes(s))
    return L2Tier(
        backend,
        f"file://{path}",
        index,
        view,
        inputs.chunk_tokens,
        s.l2_write_queue_objects,
        s.l2_prefetch_max_chunks,
        s.l2_timeout_s,
        clock,
        kind="disk",
        pin_budget_bytes=_pin_budget(inputs),
    )


def make_chain(
    config: TierConfig,
    index: L1Index,
    pool: HostPool,
    engine_name: str,
    clock: Callable[[], float],
) -> TierChain:
    """The tiers below L1 that ``config`` asks for, in order: disk, then L2."""
    inputs = config.tier_inputs()
    tiers: list[L2Tier] = []
    if inputs.settings.disk_dir:
        tiers.append(make_disk_tier(inputs, index, PoolView(pool, engine_name), clock))
    if inputs.settings.l2_url:
        tiers.append(make_tier(inputs, index, pool, engine_name, clock))
    return TierChain(tiers)
