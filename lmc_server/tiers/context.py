"""What a tier's write-behind and its prefetcher both work with, as one object.

:class:`~lmc_server.tiers.writer.WriteBehind` and :class:`~lmc_server.tiers.prefetch.Prefetcher`
read and write the same L1 index and pool through the same backend, count into the same
stats, run their copies on the same threads and report failures to the same tier: the
tier builds one :class:`TierContext` and hands it to both, so the two can never be wired
to different pieces of one tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lmc_server.cache.index import L1Index
from lmc_server.tiers.backend import L2Backend, L2Error
from lmc_server.tiers.poolview import PoolView
from lmc_server.tiers.stats import L2Stats


@dataclass(frozen=True, slots=True)
class TierContext:
    """One tier's shared parts (event-loop thread, except ``executor``'s jobs).

    ``space(namespace, layout fingerprint)`` is the L2 namespace of an object group's
    values; ``is_up()`` whether the store is reachable now; ``is_connecting()`` whether
    the tier's first connect after the start is still under way (what is committed
    meanwhile waits in the write queue instead of being dropped as ``l2_down``);
    ``on_error`` is told of every failed backend call (an unreachable store turns the
    tier degraded); ``clock`` is the server's (how long a known miss is remembered moves
    with a test's fake clock).
    """

    index: L1Index
    backend: L2Backend
    stats: L2Stats
    view: PoolView
    executor: ThreadPoolExecutor
    space: Callable[[str, bytes], bytes]
    is_up: Callable[[], bool]
    on_error: Callable[[L2Error], None]
    clock: Callable[[], float] = field(default=time.monotonic)
    is_connecting: Callable[[], bool] = field(default=lambda: False)
