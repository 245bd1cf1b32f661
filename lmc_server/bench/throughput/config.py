"""The settings of one ``lmcache bench throughput`` run.

Its own module because both the run (:mod:`.run`) and the timing loops (:mod:`.timing`)
read it, and the run imports the loops: kept in either, the other would import it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from lmc_server.bench.common import DEFAULT_CHUNK_SIZE, GeometryArgs
from lmc_server.bench.options import BACKENDS, copy_modes_opt, ints, opt


@dataclass(frozen=True)
class ThroughputConfig:
    backend: str = opt(
        "cpu", "Transfer engine of the server (and kind of KV memory).", type=BACKENDS
    )
    batches: tuple[int, ...] = opt(
        (1, 2, 4, 8, 16, 32, 64), "Chunks per request, comma-separated.", parse=ints
    )
    geometry: GeometryArgs = GeometryArgs()
    l1_size_gb: float = opt(
        2.0,
        "Server pool size (must hold three of the largest batches).",
        type=click.FloatRange(min=0.1),
    )
    separate: bool = opt(True, "Server object-group layout.", flag="--separate-object-groups")
    copy_modes: tuple[str, ...] = copy_modes_opt(
        "cuda only: copy modes to measure, comma-separated (one server each); "
        "staging:N also sets --cuda-staging-mb N."
    )
    #: ``None`` (resolved at construction): on for cuda.
    concurrent: bool = opt(
        None, "Also time a store and a retrieve in flight at once [default: on for cuda]."
    )
    #: Sustained runs, one per number of requests kept in flight (those > 1 are kept).
    inflight: tuple[int, ...] = opt(
        (1, 2),
        "Also time sustained throughput with N requests of the same kind "
        "kept in flight (a new one as soon as one completes, as a pipelining "
        "engine does), for each N > 1 of a comma-separated list; 1: single "
        "requests only.",
        parse=ints,
    )
    min_time_s: float = opt(
        0.5, "Least time spent timing each (mode, batch) point.", type=click.FloatRange(min=0)
    )
    min_iters: int = opt(3, "Least requests timed per point.", type=click.IntRange(1))
    max_iters: int = 200
    raw_iters: int = 10
    device: int = opt(0, "cuda device.", type=click.IntRange(0))
    seed: int = 0
    show_progress: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        if self.concurrent is None:
            object.__setattr__(self, "concurrent", self.backend == "cuda")
        object.__setattr__(self, "inflight", tuple(k for k in self.inflight if k > 1))
