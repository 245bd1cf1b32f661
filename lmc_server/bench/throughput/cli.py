"""``lmcache bench throughput``: the click command (options into its config, run, report)."""

from __future__ import annotations

from typing import Any

import click

from lmc_server.bench.common import GeometryArgs, emit
from lmc_server.bench.options import (
    backend_option,
    copy_modes_option,
    device_option,
    geometry_options,
    ints,
    output_options,
)


@click.command()
@backend_option("Transfer engine of the server (and kind of KV memory).")
@click.option(
    "--batches",
    default="1,2,4,8,16,32,64",
    callback=ints,
    help="Chunks per request, comma-separated.",
)
@geometry_options
@click.option(
    "--l1-size-gb",
    type=click.FloatRange(min=0.1),
    default=2.0,
    help="Server pool size (must hold three of the largest batches).",
)
@click.option(
    "--separate-object-groups/--no-separate-object-groups",
    "separate",
    default=True,
    help="Server object-group layout.",
)
@copy_modes_option(
    "cuda only: copy modes to measure, comma-separated (one server each); "
    "staging:N also sets --cuda-staging-mb N."
)
@click.option(
    "--concurrent/--no-concurrent",
    default=None,
    help="Also time a store and a retrieve in flight at once [default: on for cuda].",
)
@click.option(
    "--inflight",
    default="1,2",
    callback=ints,
    help="Also time sustained throughput with N requests of the same kind "
    "kept in flight (a new one as soon as one completes, as a pipelining "
    "engine does), for each N > 1 of a comma-separated list; 1: single "
    "requests only.",
)
@click.option(
    "--min-time-s",
    type=click.FloatRange(min=0),
    default=0.5,
    help="Least time spent timing each (mode, batch) point.",
)
@click.option(
    "--min-iters", type=click.IntRange(1), default=3, help="Least requests timed per point."
)
@device_option
@output_options
def throughput(
    backend: str,
    batches: tuple[int, ...],
    l1_size_gb: float,
    separate: bool,
    copy_modes: tuple[str, ...],
    concurrent: bool | None,
    inflight: tuple[int, ...],
    min_time_s: float,
    min_iters: int,
    device: int,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
    **geometry: Any,
) -> None:
    """Store and retrieve GB/s through a real server vs a raw copy of the same bytes."""
    from lmc_server.bench.throughput import run as tp

    cfg = tp.ThroughputConfig(
        backend=backend,
        batches=batches,
        geometry=GeometryArgs.pop(geometry),
        l1_size_gb=l1_size_gb,
        separate=separate,
        copy_modes=copy_modes,
        concurrent=backend == "cuda" if concurrent is None else concurrent,
        inflight=tuple(k for k in inflight if k > 1),
        min_time_s=min_time_s,
        min_iters=min_iters,
        device=device,
        show_progress=not no_progress,
    )
    report = tp.run(cfg)
    emit(report, tp.table(report), json_path)
    if plot_path:
        tp.plot(report, plot_path)
    if report.summary["mismatched_bytes"] or report.summary["failed_chunks"]:
        raise SystemExit(1)
