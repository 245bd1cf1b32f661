"""``lmcache bench``: click commands that build a benchmark config, run it, report.

A command's options are its config's fields (:mod:`lmc_server.bench.options`); the
command only builds the config, calls the benchmark's ``run``, then prints the table,
writes ``--json`` and draws ``--plot`` (:func:`_report`); the measuring lives in the
benchmark modules. A run whose byte checks failed exits with status 1.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import click

from lmc_server.bench import extras
from lmc_server.bench import latency as lat
from lmc_server.bench import startup as st
from lmc_server.bench.common import GeometryArgs, Report, emit
from lmc_server.bench.interference import run as itf
from lmc_server.bench.l2 import config as l2config
from lmc_server.bench.l2 import disk as l2disk
from lmc_server.bench.l2 import replay as l2replay
from lmc_server.bench.l2 import run as l2b
from lmc_server.bench.options import (
    build,
    json_option,
    no_progress_option,
    options,
    output_options,
    plot_option,
)
from lmc_server.bench.ranks import plot as rkplot
from lmc_server.bench.ranks import run as rk
from lmc_server.bench.ranks import table as rktable
from lmc_server.bench.ranks.config import RanksConfig
from lmc_server.bench.throughput import run as tp
from lmc_server.bench.throughput.config import ThroughputConfig
from lmc_server.bench.traces import replay as rp


def _report(
    report: Report,
    table: Callable[[Report], str],
    out: dict[str, Any],
    plot: Callable[[Report, str], None] | None = None,
    failed: bool = False,
) -> None:
    """Print and write ``report`` (``out``: what the output options parsed); exit 1 if
    ``failed``."""
    emit(report, table(report), out.get("json_path"))
    if plot is not None and out.get("plot_path"):
        plot(report, out["plot_path"])
    if failed:
        raise SystemExit(1)


@click.group(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "show_default": True,
        "max_content_width": 100,
    }
)
def bench() -> None:
    """Measure the server on this machine against this machine's own limits."""


def _byte_checks_failed(report: Report) -> bool:
    return bool(report.summary["mismatched_bytes"] or report.summary["failed_chunks"])


def _command(
    name: str,
    help: str,
    cfg_cls: type,
    run: Callable[[Any], Report],
    table: Callable[[Report], str],
    plot: Callable[[Report, str], None],
    failed: Callable[[Report], bool] = lambda _: False,
) -> None:
    """``lmcache bench NAME``: ``cfg_cls``'s options and the output options; runs, reports."""

    @options(cfg_cls)
    @output_options
    def command(no_progress: bool, **kw: Any) -> None:
        report = run(build(cfg_cls, kw, show_progress=not no_progress))
        _report(report, table, kw, plot, failed(report))

    bench.command(name, help=help)(command)


_command(
    "latency",
    "Round trips (p50, p99) and ops/s of ping, lookup and store/retrieve vs pyzmq echo.",
    lat.LatencyConfig,
    lat.run,
    lat.table,
    lat.plot,
)
_command(
    "startup",
    "Seconds from process start until ping answers and until the pool is ready.",
    st.StartupConfig,
    st.run,
    st.table,
    st.plot,
)
_command(
    "throughput",
    "Store and retrieve GB/s through a real server vs a raw copy of the same bytes.",
    ThroughputConfig,
    tp.run,
    tp.table,
    tp.plot,
    _byte_checks_failed,
)
_command(
    "replay",
    "Token hit ratio per eviction policy on a trace vs infinite-cache and Belady bounds.",
    rp.ReplayConfig,
    rp.run,
    rp.table,
    rp.plot,
)
_command(
    "interference",
    "The server's GB/s and the engine's loss with an engine computing on the same GPU.",
    itf.InterferenceConfig,
    itf.run,
    itf.table,
    itf.plot,
    _byte_checks_failed,
)


@bench.command()
@options(RanksConfig)
@json_option
@plot_option("Write a PNG plot here (GB/s per rank or engine).")
def ranks(**kw: Any) -> None:
    """Ranks of one engine (TP) or independent engines (DP) on one server: bytes, GB/s,
    the server's CPU per request by thread and the rate it saturates at, a dead rank."""
    try:
        report = rk.run(build(RanksConfig, kw))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    _report(report, rktable.table, kw, rkplot.plot, not report.summary["ok"])


@bench.command("l2")
@options(l2config.L2Config)
@json_option
@no_progress_option
def l2(no_progress: bool, **kw: Any) -> None:
    """L2 (Redis) GB/s and objects/s through two servers vs redis-py on the same bytes."""
    url, exe = kw["redis_url"], kw["redis_server"]
    if url and kw["redis_io_threads"] > 1:
        raise click.UsageError(
            "--redis-io-threads starts a redis-server; set io-threads on the one at --redis-url"
        )
    if url and kw["cluster_nodes"]:
        raise click.UsageError("--redis-cluster-nodes starts a cluster; not with --redis-url")
    if url and exe:
        raise click.UsageError("--redis-server starts a server; not with --redis-url")
    if url and kw["warm_store_gb"]:
        raise click.UsageError(
            "--warm-store-gb flushes the store it warms; it only warms one the bench "
            "starts, never the one at --redis-url"
        )
    if exe and shutil.which(exe) is None:
        raise click.BadParameter(f"{exe!r} is not an executable", param_hint="--redis-server")
    geometry = build(GeometryArgs, kw)
    if kw["trace"] is not None:
        if kw["replay_tier"] != "disk":
            extras.require("redis", "lmcache bench l2 --replay with the Redis tier")
        src = click.get_current_context().get_parameter_source("layers")
        if src is not None and src.name == "DEFAULT":
            geometry = GeometryArgs(**{**geometry.__dict__, "layers": 2, "sliding_groups": 1})
    elif not kw["disk_dir"]:
        extras.require("redis", "lmcache bench l2 (the Redis tier; --disk-dir for the disk tier)")
    cfg = build(
        l2config.L2Config,
        kw,
        geometry=geometry,
        redis_server=(shutil.which(exe) or "") if exe else "",
        show_progress=not no_progress,
    )
    if cfg.trace is not None:
        _report(l2replay.run(cfg), l2replay.table, kw)
        return
    run, table = (l2disk.run, l2disk.table) if cfg.disk_dir else (l2b.run, l2b.table)
    report = run(cfg)
    s = report.summary
    _report(report, table, kw, failed=bool(s["mismatched_groups"] or not s["retrieved_ok"]))
