"""``lmcache``: the server daemon and its small admin commands.

Settings come from flags, then ``LMCACHE_*`` environment variables, then a TOML file
(``--config``), then defaults. Bad values are usage errors (exit 2).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import msgspec

from lmc_server import __version__
from lmc_server.cli.options import declared_options
from lmc_server.config import (
    ClientSettings,
    Config,
    ConfigError,
    default_l1_size_gb,
    gib_text,
    load_client_toml,
    load_toml,
    physical_memory_bytes,
)
from lmc_server.net import bare_host, host_problem, tcp_endpoint

_EXAMPLES = """
\b
Examples:
  lmcache server --chunk-size 256 --separate-object-groups --l1-size-gb 100 \\
      --eviction-policy LRU
  LMCACHE_L1_SIZE_GB=16 lmcache server --backend cpu
  lmcache server --config /etc/lmcache/server.toml
"""


def _load_config_file(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value:
        try:
            ctx.default_map = {**(ctx.default_map or {}), **load_toml(value)}
        except ConfigError as e:
            raise click.BadParameter(str(e)) from None


class _LazyGroup(click.Group):
    """Loads ``lmcache bench`` only when it is named (or listed by ``--help``).

    The benchmarks pull in the test helpers, the client and plotting code; the daemon
    (``lmcache server``) and the admin commands need none of it
    (``tests/project/test_layering.py`` checks what ``lmcache server`` imports).
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), "bench"})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name == "bench":
            from lmc_server.bench.cli import bench

            return bench
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=_LazyGroup,
    context_settings={
        "help_option_names": ["-h", "--help"],
        "show_default": True,
        "max_content_width": 100,
    },
)
@click.version_option(__version__, prog_name="lmcache")
def cli() -> None:
    """lmc-server: a KV-cache server that keeps vLLM's attention KV in host memory."""


@cli.command(epilog=_EXAMPLES)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    callback=_load_config_file,
    is_eager=True,
    expose_value=False,
    envvar="LMCACHE_CONFIG",
    show_envvar=True,
    help="TOML file with settings (names as below, '-' or '_').",
)
@declared_options(Config)
def server(**kwargs: Any) -> None:
    """Run the cache server in the foreground until SIGINT or SIGTERM."""
    config = Config(**kwargs)
    if config.l1_size_gb is None:  # resolved here, so the startup log shows it
        config.l1_size_gb = default_l1_size_gb()
    try:
        config.check()
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    from lmc_server.logs import setup_logging
    from lmc_server.server.server import Server

    try:
        setup_logging(config.log_level, config.log_format, config.log_file)
    except OSError as e:
        raise click.UsageError(f"cannot open log file {config.log_file}: {e.strerror}") from None
    sys.exit(Server(config).run())


@cli.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--name",
    default="server",
    show_default=True,
    help="Certificate base name (server, or a client's name).",
)
def keygen(directory: str, name: str) -> None:
    """Create a zmq CURVE key pair: NAME.key (public) and NAME.key_secret (keep private).

    The server takes server.key_secret with --curve-secret-key-file; each client's
    NAME.key goes into the server's --curve-clients-dir; clients need server.key and
    their own NAME.key_secret.
    """
    import os

    import zmq.auth

    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        public, secret = zmq.auth.create_certificates(directory, name)
        os.chmod(secret, 0o600)
    except OSError as e:
        raise click.BadParameter(
            f"cannot write keys into {directory}: {e.strerror}", param_hint="DIRECTORY"
        ) from None
    click.echo(f"public: {public}\nsecret: {secret}")


def _load_client_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value:
        try:
            ctx.default_map = {**(ctx.default_map or {}), **load_client_toml(value)}
        except ConfigError as e:
            raise click.BadParameter(str(e)) from None


def _endpoint_options(f: Any) -> Any:
    """Where the server is and how to get in: the options of :class:`ClientSettings`
    (the server's own host and port settings, so the same flags, variables and TOML
    keys; see docs/operations.md), after ``--config``."""
    f = declared_options(ClientSettings, {"host": _check_host})(f)
    f = click.option(
        "--config",
        type=click.Path(dir_okay=False),
        callback=_load_client_config,
        is_eager=True,
        expose_value=False,
        envvar="LMCACHE_CONFIG",
        show_envvar=True,
        help="TOML file: the server's file works ([server] host and port, [client] CURVE keys).",
    )(f)
    return f


def _curve(server_key_file: str, client_secret_key_file: str) -> Any:
    """CURVE keys for a CLI client, or None; a half-given pair is a usage error."""
    if not server_key_file and not client_secret_key_file:
        return None
    if not (server_key_file and client_secret_key_file):
        raise click.UsageError(
            "CURVE needs both --curve-server-key-file and --curve-client-secret-key-file"
        )
    from lmc_server.client.core import CurveKeys

    try:
        return CurveKeys.load(server_key_file, client_secret_key_file)
    except (OSError, ValueError) as e:
        raise click.UsageError(f"cannot load CURVE keys: {e}") from None


def _check_host(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """A server address the client can connect to, or a usage error (exit 2) naming
    the mistake, never an error from zmq's depths."""
    problem = host_problem(value)
    if problem is not None:
        raise click.BadParameter(f"{value!r} {problem}")
    return value


def _client(host: str, port: int, timeout_s: float, curve: Any, hello: bool) -> Any:
    import zmq

    from lmc_server.client.sync import Client

    endpoint = tcp_endpoint(host, port)
    try:
        return Client(
            endpoint, timeout_s=timeout_s, client_name="lmcache-cli", hello=hello, curve=curve
        )
    except zmq.ZMQError as e:
        raise click.UsageError(f"cannot connect to {endpoint}: {e.strerror}") from None


@cli.command()
@_endpoint_options
def ping(
    host: str,
    port: int,
    timeout_s: float,
    curve_server_key_file: str,
    curve_client_secret_key_file: str,
) -> None:
    """Exit 0 if the server answers within the timeout, 1 otherwise."""
    curve = _curve(curve_server_key_file, curve_client_secret_key_file)
    with _client(host, port, timeout_s, curve, hello=False) as c:
        try:
            pong = c.ping()
        except TimeoutError:
            click.echo(_no_answer(host, port, timeout_s, curve), err=True)
            sys.exit(1)
    click.echo(
        f"ok: lmcache server {pong.server_version} at {c.endpoint}"
        f"{'' if pong.ready else ' (pool not ready yet)'}"
    )


def _no_answer(host: str, port: int, timeout_s: float, curve: Any) -> str:
    """Why a server did not answer, as far as the client can tell: nothing listens at
    the address (a TCP connect is refused), or something listens and stays silent,
    which with no CURVE keys given is what a CURVE server does to a plain client, and
    with keys given what it does to keys it does not accept."""
    endpoint = tcp_endpoint(host, port)
    if not _listening(host, port, min(timeout_s, 2.0)):
        return (
            f"no server answered at {endpoint}: nothing is listening there. Is "
            f"'lmcache server' running, with this --host and --port (LMCACHE_HOST, "
            f"LMCACHE_PORT)?"
        )
    if curve is None:
        return (
            f"no answer from {endpoint} within {timeout_s} s: something listens there but "
            f"did not answer. If the server uses CURVE (--curve-secret-key-file), pass "
            f"--curve-server-key-file and --curve-client-secret-key-file"
        )
    return (
        f"no answer from {endpoint} within {timeout_s} s with CURVE keys: check that "
        f"--curve-server-key-file is the server's public key and that this client's "
        f"public key (NAME.key) is in the server's --curve-clients-dir"
    )


def _listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to host:port is accepted."""
    import socket

    try:
        with socket.create_connection((bare_host(host), port), timeout=timeout_s):
            return True
    except OSError:
        return False


@cli.command()
@_endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw report as JSON.")
def stats(
    host: str,
    port: int,
    timeout_s: float,
    curve_server_key_file: str,
    curve_client_secret_key_file: str,
    as_json: bool,
) -> None:
    """Chunk size, backend, L1 capacity and use per partition, registrations, counters."""
    curve = _curve(curve_server_key_file, curve_client_secret_key_file)
    endpoint = tcp_endpoint(host, port)
    try:
        with _client(host, port, timeout_s, curve, hello=True) as c:
            report = c.stats()
    except TimeoutError:
        click.echo(_no_answer(host, port, timeout_s, curve), err=True)
        sys.exit(1)
    if as_json:  # the report's fields as JSON keys (docs/protocol.md)
        click.echo(json.dumps(msgspec.to_builtins(report), indent=2, sort_keys=True))
        return
    l1 = report.l1
    click.echo(
        f"lmcache server {report.version} at {endpoint}, backend "
        f"{report.backend}, up {report.uptime_s:.0f} s"
    )
    click.echo(
        f"chunk size {report.chunk_size}, object groups "
        f"{'separate' if report.separate_object_groups else 'combined'}, "
        f"eviction {report.eviction_policy}"
    )
    click.echo(
        f"L1: {gib_text(l1.used_bytes)} used of {gib_text(l1.capacity_bytes)} "
        f"({gib_text(l1.ready_bytes)} ready, {l1.free_slabs} free slabs), "
        f"{l1.objects} objects"
    )
    click.echo(
        f"sessions {report.sessions}, registrations {report.registrations}, leases {report.leases}"
    )
    if (d := report.disk) is not None:
        click.echo(
            f"disk {d.url} {d.state}: {d.hits} hits, {d.objects_written} objects "
            f"written, {gib_text(d.used_bytes)} of {gib_text(d.capacity_bytes)} in {d.files} "
            f"files, index {'whole' if d.rebuild.done else 'rebuilding'}"
        )
    if (l2 := report.l2) is not None:
        click.echo(f"L2 {l2.url} {l2.state}: {l2.hits} hits, {l2.objects_written} objects written")
    if (ev := report.kv_events) is not None:
        click.echo(
            f"KV events on {ev.endpoint}: next seq {ev.next_seq}, "
            f"{ev.published_objects} objects published, {ev.dropped_batches} "
            f"batches dropped, {ev.stall_resets} resets, {ev.replays} replays"
        )
    if report.partitions:
        click.echo(
            f"\n{'partition':<14}{'object B':>12}{'slabs':>8}{'objects':>10}"
            f"{'capacity':>10}{'used':>14}"
        )
        for p in report.partitions:
            click.echo(
                f"{p.name:<14}{p.object_bytes:>12}{p.slabs:>8}"
                f"{p.objects:>10}{p.capacity_objects:>10}"
                f"{gib_text(p.used_bytes):>14}"
            )
    click.echo("")
    for k, v in msgspec.structs.asdict(report.counters).items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                click.echo(f"{k}.{k2:<30} {v2}")
        else:
            click.echo(f"{k:<38} {v}")


def main() -> None:
    cli(prog_name="lmcache")


__all__ = ["cli", "main", "physical_memory_bytes"]
