"""``lmcache bench``: click commands that build a benchmark config, run it, report.

Each command only parses options into its benchmark's config dataclass, calls
``run``, then prints the table, writes ``--json`` and draws ``--plot``; the
measuring lives in the benchmark modules.
"""

from __future__ import annotations

import click

from lmc_server.bench.common import emit
from lmc_server.bench.interference import cli as interference_cli
from lmc_server.bench.l2 import cli as l2_cli
from lmc_server.bench.options import (
    backend_option,
    ints,
    output_options,
    parse_floats,
)
from lmc_server.bench.ranks import cli as ranks_cli
from lmc_server.bench.throughput import cli as throughput_cli
from lmc_server.bench.traces import cli as traces_cli


@click.group(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "show_default": True,
        "max_content_width": 100,
    }
)
def bench() -> None:
    """Measure the server on this machine against this machine's own limits."""


@bench.command()
@click.option(
    "--clients", default="1,8,64", callback=ints, help="Concurrent clients, comma-separated."
)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=0.01),
    default=1.0,
    help="Seconds timed per (operation, clients) point, ours and echo each.",
)
@output_options
def latency(
    clients: tuple[int, ...],
    duration_s: float,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
) -> None:
    """Round trips (p50, p99) and ops/s of ping, lookup and store/retrieve vs pyzmq echo."""
    from lmc_server.bench import latency as lat

    report = lat.run(
        lat.LatencyConfig(clients=clients, duration_s=duration_s, show_progress=not no_progress)
    )
    emit(report, lat.table(report), json_path)
    if plot_path:
        lat.plot(report, plot_path)


@bench.command()
@backend_option("Transfer engine of the server.")
@click.option(
    "--l1-size-gb",
    "sizes",
    default=None,
    callback=lambda c, p, v: None if v is None else tuple(parse_floats(v)),
    help="Pool sizes in GiB, comma-separated [default: 1,16; 1,16,100 on cuda].",
)
@click.option("--repeats", type=click.IntRange(1), default=3, help="Cold starts per size.")
@output_options
def startup(
    backend: str,
    sizes: tuple[float, ...] | None,
    repeats: int,
    json_path: str | None,
    plot_path: str | None,
    no_progress: bool,
) -> None:
    """Seconds from process start until ping answers and until the pool is ready."""
    from lmc_server.bench import startup as st

    if sizes is None:
        sizes = (1.0, 16.0, 100.0) if backend == "cuda" else (1.0, 16.0)
    report = st.run(
        st.StartupConfig(
            backend=backend, sizes_gb=sizes, repeats=repeats, show_progress=not no_progress
        )
    )
    emit(report, st.table(report), json_path)
    if plot_path:
        st.plot(report, plot_path)


# The commands of the benchmark families, each next to its benchmark.
for _command in (
    interference_cli.interference,
    l2_cli.l2,
    ranks_cli.ranks,
    throughput_cli.throughput,
    traces_cli.replay,
):
    bench.add_command(_command)
