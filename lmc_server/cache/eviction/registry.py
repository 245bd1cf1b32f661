"""The eviction policies by their ``--eviction-policy`` names.

The interface (:class:`~lmc_server.cache.eviction.base.EvictionPolicy`, with the
transitions a partition reports) lives in :mod:`lmc_server.cache.eviction.base`; each
policy in a module of its own. Adding a policy is one subclass registered in
:data:`POLICIES` (and its name in :mod:`lmc_server.cache.eviction.names`);
``tests/cache/test_eviction.py`` runs one contract suite over every class.
"""

from __future__ import annotations

from lmc_server.cache.eviction.arc import ARCPolicy
from lmc_server.cache.eviction.base import EvictionPolicy
from lmc_server.cache.eviction.fifo import FIFOPolicy
from lmc_server.cache.eviction.lru import LRUPolicy
from lmc_server.cache.eviction.s3fifo import S3FIFOPolicy
from lmc_server.cache.eviction.sarc import SARCPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, FIFOPolicy, ARCPolicy, S3FIFOPolicy, SARCPolicy)
}


def make_policy(name: str, capacity: int = 0) -> EvictionPolicy:
    """Instantiate a policy by its ``--eviction-policy`` name (case-insensitive)."""
    try:
        cls = POLICIES[name.upper()]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None
    return cls(capacity)  # type: ignore[call-arg]
