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
from lmc_server.cache.eviction import POLICIES, POLICY_HELP
from lmc_server.config import (
    BACKENDS,
    CUDA_COPY_MODES,
    GIB,
    LOG_LEVELS,
    METRICS_PORT,
    Config,
    ConfigError,
    default_l1_size_gb,
    load_client_toml,
    load_toml,
    physical_memory_bytes,
)
from lmc_server.net import host_problem, tcp_endpoint

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
    (``tests/test_layering.py`` checks what ``lmcache server`` imports).
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), "bench"})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name == "bench":
            from lmc_server.bench.cli import bench

            return bench
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup,
             context_settings={"help_option_names": ["-h", "--help"],
                               "show_default": True, "max_content_width": 100})
@click.version_option(__version__, prog_name="lmcache")
def cli() -> None:
    """lmc-server: a KV-cache server that keeps vLLM's attention KV in host memory."""


@cli.command(epilog=_EXAMPLES)
@click.option("--config", type=click.Path(dir_okay=False), callback=_load_config_file,
              is_eager=True, expose_value=False, envvar="LMCACHE_CONFIG",
              help="TOML file with settings (names as below, '-' or '_').")
@click.option("--host", default="127.0.0.1", envvar="LMCACHE_HOST",
              help="Address to listen on (tcp): IPv4, IPv6 (::1 or [::1]) or a name; "
                   "loopback only unless CURVE is configured.")
@click.option("--port", type=click.IntRange(1, 65535), default=5555, envvar="LMCACHE_PORT",
              help="TCP port for clients.")
@click.option("--chunk-size", type=click.IntRange(1, 1 << 20), default=Config.chunk_size,
              envvar="LMCACHE_CHUNK_SIZE",
              help="Tokens per chunk (the caching unit); must be a multiple of every "
                   "cached group's tokens per block.")
@click.option("--separate-object-groups/--no-separate-object-groups", default=False,
              envvar="LMCACHE_SEPARATE_OBJECT_GROUPS",
              help="One object per chunk per retention need (full vs each sliding "
                   "window) instead of one object per chunk.")
@click.option("--l1-size-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              envvar="LMCACHE_L1_SIZE_GB",
              help=f"L1 pool size in GiB [default: a quarter of this machine's memory, "
                   f"{default_l1_size_gb():.0f} here].")
@click.option("--eviction-policy", type=click.Choice(list(POLICIES), case_sensitive=False),
              default="LRU", envvar="LMCACHE_EVICTION_POLICY", help=POLICY_HELP)
@click.option("--backend", type=click.Choice(BACKENDS), default="auto",
              envvar="LMCACHE_BACKEND",
              help="Transfer engine: cuda (GPU workers), cpu (shared memory), auto "
                   "(cuda when a GPU and CuPy are present), or null (moves no bytes; "
                   "trace-replay benchmarks only).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              default="INFO", envvar="LMCACHE_LOG_LEVEL", help="Log level.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              envvar="LMCACHE_LOG_FORMAT", help="Log line format.")
@click.option("--log-file", default="", envvar="LMCACHE_LOG_FILE",
              help="Append logs to this file instead of stderr; SIGHUP reopens it "
                   "(for logrotate).")
@click.option("--lease-ttl-s", type=click.FloatRange(min=0, min_open=True), default=30.0,
              envvar="LMCACHE_LEASE_TTL_S",
              help="Seconds a lookup's lease keeps its chunks from eviction.")
@click.option("--slab-size-mb", type=click.IntRange(1, 4096), default=64,
              envvar="LMCACHE_SLAB_SIZE_MB",
              help="Pool slab size in MiB (largest object; unit moved between partitions).")
@click.option("--copy-threads", type=click.IntRange(0, 256), default=0,
              envvar="LMCACHE_COPY_THREADS",
              help="Copy threads of the cpu engine (0: min(4, cores)).")
@click.option("--cuda-copy-mode", type=click.Choice(CUDA_COPY_MODES),
              default=Config.cuda_copy_mode, envvar="LMCACHE_CUDA_COPY_MODE",
              help="cuda engine: 'dma' moves pages with the GPU's copy engines alone (no "
                   "kernel: nearly free for an engine computing on the same GPU); "
                   "'staging' gathers pages with a short kernel into a staging buffer and "
                   "moves it in one DMA (fastest on an idle GPU); 'auto' takes dma while "
                   "the GPU runs kernels (NVML), staging while it is idle; 'mapped' has a "
                   "kernel read/write pinned host memory. See docs/gpu.md.")
@click.option("--cuda-staging-mb", type=click.IntRange(1, 4096), default=Config.cuda_staging_mb,
              envvar="LMCACHE_CUDA_STAGING_MB",
              help="cuda staging mode: least size in MiB of each of the two staging halves "
                   "per copy lane (GPU memory of the worker's device: 4 lanes x 2 halves).")
@click.option("--pipeline-mb", type=click.IntRange(-1, 1 << 20), default=-1,
              envvar="LMCACHE_PIPELINE_MB",
              help="Stores larger than this many MiB are reserved and copied in up to four "
                   "sub-batches, the first copying while the next is prepared (0: never; "
                   "-1: the engine's default, which is 0 on cpu and cuda).")
@click.option("--max-frame-bytes", type=click.IntRange(65536, 1 << 30),
              default=Config.max_frame_bytes, envvar="LMCACHE_MAX_FRAME_BYTES",
              help="Largest request frame answered; larger ones get too_large.")
@click.option("--drain-timeout-s", type=click.FloatRange(min=0), default=10.0,
              envvar="LMCACHE_DRAIN_TIMEOUT_S",
              help="On SIGTERM, how long in-flight copies may take to finish.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=METRICS_PORT,
              envvar="LMCACHE_METRICS_PORT", help="Prometheus /metrics port (0: off).")
@click.option("--metrics-host", default="127.0.0.1", envvar="LMCACHE_METRICS_HOST",
              help="Address of the metrics endpoint.")
@click.option("--heartbeat-timeout-s", type=click.FloatRange(0.5, 3600), default=4.0,
              envvar="LMCACHE_HEARTBEAT_TIMEOUT_S",
              help="A client whose connection is silent this long (zmq heartbeats) is "
                   "dropped and its registrations, mappings and leases reclaimed.")
@click.option("--max-inflight-per-client", type=click.IntRange(1, 65536), default=64,
              envvar="LMCACHE_MAX_INFLIGHT_PER_CLIENT",
              help="Concurrent stores and retrieves per connection; more get 'busy'.")
@click.option("--ipc-path", default="", envvar="LMCACHE_IPC_PATH",
              help="Also listen on ipc://PATH; its folder is created mode 0700 (0770 with "
                   "--ipc-group).")
@click.option("--ipc-group", default="", envvar="LMCACHE_IPC_GROUP",
              help="Group (the engine's) allowed to use the ipc socket.")
@click.option("--curve-secret-key-file", default="", envvar="LMCACHE_CURVE_SECRET_KEY_FILE",
              help="zmq CURVE server certificate (from 'lmcache keygen'); required to "
                   "listen on a non-loopback address.")
@click.option("--curve-clients-dir", default="", envvar="LMCACHE_CURVE_CLIENTS_DIR",
              help="Folder of client public certificates allowed to connect with CURVE.")
@click.option("--memory-check/--no-memory-check", default=True,
              envvar="LMCACHE_MEMORY_CHECK",
              help="Refuse an --l1-size-gb larger than this machine's memory (less 2 GiB). "
                   "Turn off only where the reported memory understates what the machine "
                   "really has (memory that grows on use, as in some VMs).")
@click.option("--l2", "l2_url", default="", envvar="LMCACHE_L2", metavar="URL",
              help="L2 tier shared across hosts: redis://HOST:PORT/DB (rediss:// for TLS, "
                   "valkey:// too) or mooncake://MASTER:PORT. The password comes from "
                   "LMCACHE_L2_PASSWORD or --l2-password-file, never the URL. See docs/l2.md.")
@click.option("--l2-password-file", default="", envvar="LMCACHE_L2_PASSWORD_FILE",
              help="File whose first line is the L2 password.")
@click.option("--l2-write-queue-objects", type=click.IntRange(1, 1 << 24), default=4096,
              envvar="LMCACHE_L2_WRITE_QUEUE_OBJECTS",
              help="Objects waiting to be written to L2; past this, writes are dropped "
                   "(counted).")
@click.option("--l2-prefetch-max-chunks", type=click.IntRange(1, 16384), default=256,
              envvar="LMCACHE_L2_PREFETCH_MAX_CHUNKS",
              help="Chunks after an L1 hit that one lookup asks L2 for.")
@click.option("--l2-timeout-s", type=click.FloatRange(0.05, 60), default=2.0,
              envvar="LMCACHE_L2_TIMEOUT_S", help="L2 connect and call timeout.")
@click.option("--l2-connections", type=click.IntRange(1, 16), default=1,
              envvar="LMCACHE_L2_CONNECTIONS",
              help="Redis connections for reads, and as many for writes; a batch is split "
                   "across them.")
@click.option("--disk-dir", default="", envvar="LMCACHE_DISK_DIR", metavar="PATH",
              help="Disk tier between L1 and L2: a directory on local NVMe or a shared "
                   "filesystem (PATH or file:///PATH). Needs --disk-size-gb. See docs/l2.md.")
@click.option("--disk-size-gb", type=click.FloatRange(0, 1 << 20), default=0.0,
              envvar="LMCACHE_DISK_SIZE_GB",
              help="Bytes the disk tier may hold; the least recently used files go first.")
@click.option("--kv-events-endpoint", default="", envvar="LMCACHE_KV_EVENTS_ENDPOINT",
              metavar="ENDPOINT",
              help="Publish L1 stores and removals for KV-aware routers, in vLLM's "
                   "KV-event format, on this ZeroMQ PUB endpoint; as vLLM does, a "
                   "wildcard (tcp://*:5557) or ipc:// endpoint is bound, any other "
                   "connected to (a router's bound SUB). The stream carries prompt tokens: "
                   "expose it only to the router. See docs/operations.md.")
@click.option("--kv-events-replay-endpoint", default="",
              envvar="LMCACHE_KV_EVENTS_REPLAY_ENDPOINT", metavar="ENDPOINT",
              help="ROUTER endpoint where subscribers ask for missed batches (vLLM's "
                   "replay protocol).")
@click.option("--kv-events-topic", default="", envvar="LMCACHE_KV_EVENTS_TOPIC",
              help="Topic prefix; each model publishes on PREFIX<model>. Default "
                   "kv@<hostname>@ (llm-d's kv@<pod>@<model>).")
@click.option("--kv-events-hwm", type=click.IntRange(1, 1 << 24), default=100_000,
              envvar="LMCACHE_KV_EVENTS_HWM",
              help="Batches queued per subscriber; past it batches are dropped for "
                   "everyone (counted, still replayable), never waited for.")
@click.option("--kv-events-replay-batches", type=click.IntRange(1, 1 << 20),
              default=10_000, envvar="LMCACHE_KV_EVENTS_REPLAY_BATCHES",
              help="Batches kept for replay.")
def server(**kwargs: Any) -> None:
    """Run the cache server in the foreground until SIGINT or SIGTERM."""
    if kwargs["l1_size_gb"] is None:  # resolved here, so the startup log shows it
        kwargs["l1_size_gb"] = default_l1_size_gb()
    config = Config(**kwargs)
    try:
        config.check()
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    from lmc_server.logs import setup_logging
    from lmc_server.server.server import Server

    try:
        setup_logging(config.log_level, config.log_format, config.log_file)
    except OSError as e:
        raise click.UsageError(f"cannot open log file {config.log_file}: {e.strerror}") \
            from None
    sys.exit(Server(config).run())


@cli.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="server", show_default=True,
              help="Certificate base name (server, or a client's name).")
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
        raise click.BadParameter(f"cannot write keys into {directory}: {e.strerror}",
                                 param_hint="DIRECTORY") from None
    click.echo(f"public: {public}\nsecret: {secret}")


def _load_client_config(ctx: click.Context, _param: click.Parameter,
                        value: str | None) -> None:
    if value:
        try:
            ctx.default_map = {**(ctx.default_map or {}), **load_client_toml(value)}
        except ConfigError as e:
            raise click.BadParameter(str(e)) from None


def _endpoint_options(f: Any) -> Any:
    """Where the server is and how to get in: the same host, port and CURVE settings,
    environment variables and TOML file as the server (see docs/operations.md)."""
    f = click.option("--curve-client-secret-key-file", default="",
                     envvar="LMCACHE_CURVE_CLIENT_SECRET_KEY_FILE",
                     help="This client's CURVE certificate with its secret key (NAME."
                          "key_secret from 'lmcache keygen --name NAME'; its NAME.key must "
                          "be in the server's --curve-clients-dir).")(f)
    f = click.option("--curve-server-key-file", default="",
                     envvar="LMCACHE_CURVE_SERVER_KEY_FILE",
                     help="The server's public CURVE certificate (server.key); with a "
                          "client certificate, talk CURVE.")(f)
    f = click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), default=2.0,
                     help="Seconds to wait for an answer.")(f)
    f = click.option("--port", type=click.IntRange(1, 65535), default=5555,
                     envvar="LMCACHE_PORT", help="Server port.")(f)
    f = click.option("--host", default="127.0.0.1", envvar="LMCACHE_HOST",
                     callback=_check_host,
                     help="Server address (IPv4, IPv6 with or without brackets, or a name).")(f)
    f = click.option("--config", type=click.Path(dir_okay=False),
                     callback=_load_client_config, is_eager=True, expose_value=False,
                     envvar="LMCACHE_CONFIG",
                     help="TOML file: the server's file works ([server] host and port, "
                          "[client] CURVE keys).")(f)
    return f


def _curve(server_key_file: str, client_secret_key_file: str) -> Any:
    """CURVE keys for a CLI client, or None; a half-given pair is a usage error."""
    if not server_key_file and not client_secret_key_file:
        return None
    if not (server_key_file and client_secret_key_file):
        raise click.UsageError("CURVE needs both --curve-server-key-file and "
                               "--curve-client-secret-key-file")
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
        return Client(endpoint, timeout_s=timeout_s, client_name="lmcache-cli",
                      hello=hello, curve=curve)
    except zmq.ZMQError as e:
        raise click.UsageError(f"cannot connect to {endpoint}: {e.strerror}") from None


@cli.command()
@_endpoint_options
def ping(host: str, port: int, timeout_s: float, curve_server_key_file: str,
         curve_client_secret_key_file: str) -> None:
    """Exit 0 if the server answers within the timeout, 1 otherwise."""
    curve = _curve(curve_server_key_file, curve_client_secret_key_file)
    with _client(host, port, timeout_s, curve, hello=False) as c:
        try:
            pong = c.ping()
        except TimeoutError:
            click.echo(f"no answer from {c.endpoint} within {timeout_s} s"
                       f"{_curve_hint(curve)}", err=True)
            sys.exit(1)
    click.echo(f"ok: lmcache server {pong.server_version} at {c.endpoint}"
               f"{'' if pong.ready else ' (pool not ready yet)'}")


def _curve_hint(curve: Any) -> str:
    return ("" if curve is not None else
            " (a CURVE server does not answer clients without keys: see "
            "--curve-server-key-file)")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@cli.command()
@_endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw report as JSON.")
def stats(host: str, port: int, timeout_s: float, curve_server_key_file: str,
          curve_client_secret_key_file: str, as_json: bool) -> None:
    """Chunk size, backend, L1 capacity and use per partition, registrations, counters."""
    curve = _curve(curve_server_key_file, curve_client_secret_key_file)
    endpoint = tcp_endpoint(host, port)
    try:
        with _client(host, port, timeout_s, curve, hello=True) as c:
            report = c.stats()
    except TimeoutError:
        click.echo(f"no answer from {endpoint} within {timeout_s} s{_curve_hint(curve)}",
                   err=True)
        sys.exit(1)
    if as_json:  # the report's fields as JSON keys (docs/protocol.md)
        click.echo(json.dumps(msgspec.to_builtins(report), indent=2, sort_keys=True))
        return
    l1 = report.l1
    click.echo(f"lmcache server {report.version} at {endpoint}, backend "
               f"{report.backend}, up {report.uptime_s:.0f} s")
    click.echo(f"chunk size {report.chunk_size}, object groups "
               f"{'separate' if report.separate_object_groups else 'combined'}, "
               f"eviction {report.eviction_policy}")
    click.echo(f"L1: {_gib(l1.used_bytes)} used of {_gib(l1.capacity_bytes)} "
               f"({_gib(l1.ready_bytes)} ready, {l1.free_slabs} free slabs), "
               f"{l1.objects} objects")
    click.echo(f"sessions {report.sessions}, registrations {report.registrations}, "
               f"leases {report.leases}")
    if (d := report.disk) is not None:
        click.echo(f"disk {d.url} {d.state}: {d.hits} hits, {d.objects_written} objects "
                   f"written, {_gib(d.used_bytes)} of {_gib(d.capacity_bytes)} in {d.files} "
                   f"files, index {'whole' if d.rebuild.done else 'rebuilding'}")
    if (l2 := report.l2) is not None:
        click.echo(f"L2 {l2.url} {l2.state}: {l2.hits} hits, {l2.objects_written} objects "
                   f"written")
    if (ev := report.kv_events) is not None:
        click.echo(f"KV events on {ev.endpoint}: next seq {ev.next_seq}, "
                   f"{ev.published_objects} objects published, {ev.dropped_batches} "
                   f"batches dropped, {ev.stall_resets} resets, {ev.replays} replays")
    if report.partitions:
        click.echo(f"\n{'partition':<14}{'object B':>12}{'slabs':>8}{'objects':>10}"
                   f"{'capacity':>10}{'used':>14}")
        for p in report.partitions:
            click.echo(f"{p.name:<14}{p.object_bytes:>12}{p.slabs:>8}"
                       f"{p.objects:>10}{p.capacity_objects:>10}"
                       f"{_gib(p.used_bytes):>14}")
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
