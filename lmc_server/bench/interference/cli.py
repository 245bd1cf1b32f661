"""``lmcache bench interference``: the click command (options into its config, run, report)."""

from __future__ import annotations

from typing import Any

import click

from lmc_server.bench.common import GeometryArgs, emit
from lmc_server.bench.options import (
    copy_modes_option,
    device_option,
    geometry_options,
    ints,
    names,
    output_options,
)


@click.command()
@click.option(
    "--engines",
    default="gemm,hbm",
    callback=names(("gemm", "hbm", "decode"), "--engines"),
    help="Engine workloads beside the server: gemm (bf16 8192^3 matmuls), hbm "
    "(1 GiB device copies), decode (a CUDA graph of small kernels).",
)
@copy_modes_option(
    "Server copy modes, comma-separated (one server each); staging:N also sets --cuda-staging-mb N."
)
@click.option(
    "--ops",
    default="store,retrieve,both",
    callback=names(("store", "retrieve", "both"), "--ops"),
    help="Server loops: store, retrieve (lookup + retrieve + release), both.",
)
@click.option("--chunks", default="64", callback=ints, help="Chunks per request.")
@click.option(
    "--inflight",
    default="1,2",
    callback=ints,
    help="Requests of each kind kept in flight, comma-separated.",
)
@click.option(
    "--seconds", type=click.FloatRange(min=0.2), default=1.5, help="Length of each measured window."
)
@click.option(
    "--own-copy/--no-own-copy",
    default=True,
    help="Also measure the engine's own side-stream copy of the same bytes.",
)
@geometry_options
@click.option("--l1-size-gb", type=click.FloatRange(min=0.5), default=4.0, help="Server pool size.")
@click.option(
    "--block-order",
    type=click.Choice(["consecutive", "random"]),
    default="consecutive",
    help="Block ids of a request: consecutive (a fresh engine) or a random "
    "permutation (an engine's block pool after churn).",
)
@device_option
@output_options
def interference(
    engines: tuple[str, ...],
    copy_modes: tuple[str, ...],
    ops: tuple[str, ...],
    chunks: tuple[int, ...],
    inflight: tuple[int, ...],
    seconds: float,
    own_copy: bool,
    l1_size_gb: float,
    block_order: str,
    device: int,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
    **geometry: Any,
) -> None:
    """The server's GB/s and the engine's loss with an engine computing on the same GPU."""
    from lmc_server.bench.interference import run as itf

    report = itf.run(
        itf.InterferenceConfig(
            engines=engines,
            copy_modes=copy_modes,
            ops=ops,
            chunks=chunks,
            inflight=inflight,
            seconds=seconds,
            own_copy=own_copy,
            geometry=GeometryArgs.pop(geometry),
            l1_size_gb=l1_size_gb,
            block_order=block_order,
            device=device,
            show_progress=not no_progress,
        )
    )
    emit(report, itf.table(report), json_path)
    if plot_path:
        itf.plot(report, plot_path)
    if report.summary["mismatched_bytes"] or report.summary["failed_chunks"]:
        raise SystemExit(1)
