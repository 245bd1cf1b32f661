"""The settings of one ``lmcache bench throughput`` run.

Its own module because both the run (:mod:`.run`) and the timing loops (:mod:`.timing`)
read it, and the run imports the loops: kept in either, the other would import it back.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmc_server.bench.common import DEFAULT_CHUNK_SIZE, GeometryArgs


@dataclass(frozen=True)
class ThroughputConfig:
    backend: str = "cpu"
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    geometry: GeometryArgs = GeometryArgs()
    l1_size_gb: float = 2.0
    separate: bool = True
    copy_modes: tuple[str, ...] = ("staging",)
    concurrent: bool = False
    #: Sustained runs, one per number of requests kept in flight (each > 1).
    inflight: tuple[int, ...] = ()
    min_time_s: float = 0.5
    min_iters: int = 3
    max_iters: int = 200
    raw_iters: int = 10
    device: int = 0
    seed: int = 0
    show_progress: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE
