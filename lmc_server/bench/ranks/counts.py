"""Per-rank outcome counts of ``lmcache bench ranks``, one :class:`Counts` per direction.

A rank (tensor-parallel, or data-parallel engine) counts what the server replied to each
request: chunk statuses, bytes copied (OK statuses x the object group's object bytes),
seconds spent waiting, and errors (a few kept as samples). The parent sums these.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmc_server.bench.ranks.config import MAX_ERRORS_KEPT
from lmc_server.cache.status import ChunkStatus
from lmc_server.client.core import ChunkResult


class Counts:
    """Outcomes of one direction on one rank: statuses, bytes copied, errors."""

    def __init__(self, object_bytes: dict[str, int]) -> None:
        self.object_bytes = object_bytes
        self.requests = 0
        self.status: dict[str, int] = {s.name.lower(): 0 for s in ChunkStatus}
        self.copied_bytes = 0
        self.busy_s = 0.0
        self.errors: list[str] = []
        self.n_errors = 0

    def add(self, res: ChunkResult, seconds: float) -> None:
        self.requests += 1
        self.busy_s += seconds
        for og, st in res.statuses.items():
            counts = np.bincount(st, minlength=len(ChunkStatus))
            for s in ChunkStatus:
                self.status[s.name.lower()] += int(counts[s])
            self.copied_bytes += int(counts[ChunkStatus.OK]) * self.object_bytes[og]

    def error(self, e: BaseException) -> None:
        self.n_errors += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(f"{type(e).__name__}: {e}")

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "status": self.status,
            "copied_bytes": self.copied_bytes,
            "busy_s": self.busy_s,
            "errors": self.n_errors,
            "error_samples": self.errors,
        }
