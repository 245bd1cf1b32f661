"""``lmcache bench replay``: the click command (options into its config, run, report)."""

from __future__ import annotations

from typing import Any

import click

from lmc_server.bench.common import GeometryArgs, emit
from lmc_server.bench.options import (
    floats,
    geometry_options,
    output_options,
)


@click.command()
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False),
    required=True,
    help="Trace file (JSON lines: timestamp, input_length, hash_ids).",
)
@click.option(
    "--fractions",
    default="0.01,0.05,0.1,0.25,0.5",
    callback=floats,
    help="L1 sizes as fractions of the trace's distinct chunk bytes.",
)
@click.option(
    "--policies", default="LRU,FIFO,ARC,S3FIFO,SARC", help="Eviction policies, comma-separated."
)
@click.option(
    "--limit", type=click.IntRange(1), default=None, help="Replay only the first N requests."
)
@click.option(
    "--slab-size-mb",
    type=click.IntRange(1, 4096),
    default=64,
    help="Server slab size (capacity is whole slabs of whole objects).",
)
@geometry_options
@output_options
def replay(
    trace_path: str,
    fractions: tuple[float, ...],
    policies: str,
    limit: int | None,
    slab_size_mb: int,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
    **geometry: Any,
) -> None:
    """Token hit ratio per eviction policy on a trace vs infinite-cache and Belady bounds."""
    from lmc_server.bench.traces import replay as rp
    from lmc_server.cache.eviction import POLICIES

    names = tuple(p.strip().upper() for p in policies.split(",") if p.strip())
    bad = set(names) - set(POLICIES)
    if bad or not names:
        raise click.BadParameter(f"choose from {', '.join(POLICIES)}", param_hint="--policies")
    report = rp.run(
        rp.ReplayConfig(
            trace=trace_path,
            fractions=fractions,
            policies=names,
            geometry=GeometryArgs.pop(geometry),
            slab_size_mb=slab_size_mb,
            limit=limit,
            show_progress=not no_progress,
        )
    )
    emit(report, rp.table(report), json_path)
    if plot_path:
        rp.plot(report, plot_path)
