"""``lmcache bench ranks``: the click command (options into its config, run, report)."""

from __future__ import annotations

from typing import Any

import click

from lmc_server.bench.common import GeometryArgs, emit
from lmc_server.bench.options import (
    backend_option,
    geometry_options,
    ints,
    json_option,
    plot_option,
)
from lmc_server.bench.ranks.config import MAX_TP_INFLIGHT


def _optional_ints(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[int, ...] | None:
    return None if value is None else ints(ctx, param, value)


@click.command()
@click.option(
    "--mode",
    type=click.Choice(["tp", "dp"]),
    default="tp",
    help="tp: the tensor-parallel ranks of one engine (replicated KV; phases 1-3 "
    "and the TP phases). dp: independent data-parallel engines, each rank 0 of "
    "world size 1 (one namespace), storing their own prompts and loading "
    "prefixes any engine stored, at their own pace (the DP phase, phase 3).",
)
@backend_option("Transfer engine of the server; cuda: ranks round-robin over the GPUs.")
@click.option(
    "--ranks",
    type=click.IntRange(1, 256),
    default=8,
    help="Worker processes, one registration each (TP ranks, or DP engines).",
)
@click.option(
    "--chunks",
    type=click.IntRange(1),
    default=1000,
    help="Chunks rank 0 stores in phase 1 (and slots of each KV region).",
)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=0.1),
    default=60.0,
    help="Seconds of concurrent store/retrieve on every rank (phase 2; the DP "
    "phase with --mode dp).",
)
@click.option(
    "--kill-one/--no-kill-one",
    default=True,
    help="SIGKILL the last rank halfway through phase 2 or the DP phase (phase 3).",
)
@geometry_options
@click.option(
    "--num-blocks",
    type=click.IntRange(1),
    default=None,
    help="Blocks per KV group [default: the least two regions of --chunks need].",
)
@click.option(
    "--batch",
    type=click.IntRange(1),
    default=16,
    help="Chunks per request in phase 1 stores and phase 2; with --mode dp, "
    "chunks per prompt (each store, and the longest load).",
)
@click.option(
    "--l1-size-gb",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Server pool [default: twice the phase-1 bytes plus 1 GiB].",
)
@click.option(
    "--verify-every",
    type=click.IntRange(1),
    default=8,
    help="Phase 2: compare every n-th successful retrieve byte for byte (DP "
    "mode compares every load).",
)
@click.option(
    "--raw-s",
    type=click.FloatRange(min=0.01),
    default=1.0,
    help="Seconds of each raw-copy baseline direction.",
)
@click.option(
    "--tp-modes",
    default="load,mixed",
    show_default=True,
    help="Steady-state TP phases, comma-separated: load (every rank retrieves the "
    "same prefix at once), mixed (and rank 0 stores meanwhile); '' for none.",
)
@click.option(
    "--tp-s",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds each TP phase runs.",
)
@click.option(
    "--tp-chunks",
    default=None,
    callback=_optional_ints,
    help="Chunks per TP request (the prefix length), comma-separated (1,4,16,64): "
    "each TP mode runs for every pair of --tp-chunks and --tp-inflight; at most "
    "--chunks [default: --batch].",
)
@click.option(
    "--tp-inflight",
    default="1",
    show_default=True,
    callback=ints,
    help=f"Requests each rank keeps in flight in the TP phases, comma-separated "
    f"(1,2,4; each at most {MAX_TP_INFLIGHT}).",
)
@json_option
@plot_option("Write a PNG plot here (GB/s per rank or engine).")
def ranks(
    mode: str,
    backend: str,
    ranks: int,
    chunks: int,
    duration_s: float,
    kill_one: bool,
    num_blocks: int | None,
    batch: int,
    l1_size_gb: float | None,
    verify_every: int,
    raw_s: float,
    json_path: str | None,
    plot_path: str | None,
    tp_modes: str,
    tp_s: float,
    tp_chunks: tuple[int, ...] | None,
    tp_inflight: tuple[int, ...],
    **geometry: Any,
) -> None:
    """Ranks of one engine (TP) or independent engines (DP) on one server: bytes, GB/s,
    the server's CPU per request by thread and the rate it saturates at, a dead rank."""
    from lmc_server.bench.ranks import run as rk
    from lmc_server.bench.ranks.config import RanksConfig
    from lmc_server.bench.ranks.table import table

    cfg = RanksConfig(
        mode=mode,
        backend=backend,
        ranks=ranks,
        chunks=chunks,
        duration_s=duration_s,
        kill_one=kill_one,
        geometry=GeometryArgs.pop(geometry),
        num_blocks=num_blocks,
        batch=min(batch, chunks),
        l1_size_gb=l1_size_gb,
        verify_every=verify_every,
        raw_s=raw_s,
        tp_modes=tuple(m for m in tp_modes.split(",") if m),
        tp_s=tp_s,
        tp_chunks=tp_chunks,
        tp_inflight=tp_inflight,
    )
    try:
        report = rk.run(cfg)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    emit(report, table(report), json_path)
    if plot_path:
        from lmc_server.bench.ranks.plot import plot

        plot(report, plot_path)
    if not report.summary["ok"]:
        raise SystemExit(1)
