"""Errors that say what to do: each mistake a new user makes on the command line is
refused with its exit status and a message naming what was wrong and the fix, never a
traceback, a flag the user did not type, or a cause that is not the cause."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq.auth
from click.testing import CliRunner

from lmc_server.cli.main import cli
from lmc_server.config import Config, ConfigError, declarations
from lmc_server.testing.process import free_port

EXIT_USAGE, EXIT_STARTUP_FAILURE = 2, 3


def lmcache(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmc_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def refused(out: subprocess.CompletedProcess[str], status: int, *needles: str) -> None:
    assert out.returncode == status, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr)


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A TCP port where something accepts connections and never answers (what a CURVE
    server is to a client without keys)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


SERVER = ["server", "--backend", "cpu", "--l1-size-gb", "0.25"]


# -- the settings file --------------------------------------------------------------------


@pytest.mark.parametrize("command", ["server", "ping", "stats"])
def test_a_misspelled_table_is_named_with_the_known_tables(tmp_path: Path, command: str) -> None:
    toml = tmp_path / "server.toml"
    toml.write_text('[server]\nport = 5600\n\n[clinet]\ncurve_server_key_file = "k"\n')
    refused(
        lmcache(command, "--config", str(toml)),
        EXIT_USAGE,
        "unknown table [clinet]",
        "known tables: [server], [client]",
    )


def test_settings_both_at_top_level_and_under_server_are_refused(tmp_path: Path) -> None:
    toml = tmp_path / "server.toml"
    toml.write_text("port = 5600\n\n[server]\nchunk_size = 256\n")
    res = CliRunner().invoke(cli, ["server", "--config", str(toml)])
    assert res.exit_code == EXIT_USAGE, res.output
    assert "both at top level (port) and under [server]" in res.output


# -- addresses taken ----------------------------------------------------------------------


def test_a_taken_metrics_port_names_the_address_and_the_flag(silent_listener: int) -> None:
    out = lmcache(*SERVER, "--port", str(free_port()), "--metrics-port", str(silent_listener))
    refused(
        out,
        EXIT_STARTUP_FAILURE,
        f"cannot serve metrics on http://127.0.0.1:{silent_listener}",
        "choose another --metrics-port",
    )


def test_a_taken_server_port_names_the_endpoint_and_the_flag(silent_listener: int) -> None:
    out = lmcache(*SERVER, "--port", str(silent_listener), "--metrics-port", "0")
    refused(
        out,
        EXIT_STARTUP_FAILURE,
        f"cannot listen on tcp://127.0.0.1:{silent_listener}",
        "choose another --port",
    )


# -- a server that does not answer ----------------------------------------------------------


@pytest.mark.parametrize("command", ["ping", "stats"])
def test_no_server_running_is_said_so_without_blaming_curve(command: str) -> None:
    port = free_port()
    out = lmcache(command, "--port", str(port), "--timeout-s", "0.3")
    assert out.returncode == 1, out.stderr
    assert f"no server answered at tcp://127.0.0.1:{port}: nothing is listening" in out.stderr
    assert "CURVE" not in out.stderr and "curve" not in out.stderr


@pytest.mark.parametrize("command", ["ping", "stats"])
def test_a_silent_listener_without_keys_gets_the_curve_hint(
    command: str, silent_listener: int
) -> None:
    out = lmcache(command, "--port", str(silent_listener), "--timeout-s", "0.3")
    assert out.returncode == 1, out.stderr
    assert "something listens there but did not answer" in out.stderr
    assert "--curve-server-key-file and --curve-client-secret-key-file" in out.stderr


def test_a_silent_listener_with_keys_points_at_the_keys(
    tmp_path: Path, silent_listener: int
) -> None:
    server_public, _ = zmq.auth.create_certificates(str(tmp_path), "server")
    _, client_secret = zmq.auth.create_certificates(str(tmp_path), "ops")
    out = lmcache(
        "ping",
        "--port",
        str(silent_listener),
        "--timeout-s",
        "0.3",
        "--curve-server-key-file",
        server_public,
        "--curve-client-secret-key-file",
        client_secret,
    )
    assert out.returncode == 1, out.stderr
    assert "with CURVE keys" in out.stderr and "--curve-clients-dir" in out.stderr


# -- the environment ----------------------------------------------------------------------


def test_a_bad_environment_value_names_the_variable() -> None:
    refused(
        lmcache("server", env={"LMCACHE_CHUNK_SIZE": "abc"}),
        EXIT_USAGE,
        "Invalid value for LMCACHE_CHUNK_SIZE (the environment's --chunk-size): 'abc'",
    )
    refused(
        lmcache("ping", env={"LMCACHE_PORT": "abc"}),
        EXIT_USAGE,
        "Invalid value for LMCACHE_PORT (the environment's --port): 'abc'",
    )


def test_help_shows_every_options_environment_variable() -> None:
    server_help = CliRunner().invoke(cli, ["server", "--help"], terminal_width=400).output
    flat = " ".join(server_help.split())
    for d in declarations(Config):
        assert f"env var: {d.envvar}" in flat, d.envvar
    assert "env var: LMCACHE_CONFIG" in flat
    for command in ("ping", "stats"):
        text = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split())
        for var in ("LMCACHE_HOST", "LMCACHE_PORT", "LMCACHE_CONFIG"):
            assert f"env var: {var}" in text, (command, var)


# -- settings of a tier that is not configured ----------------------------------------------


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--l2-password-file", "/run/secrets/l2"], "--l2-password-file is a setting of the L2"),
        (["--l2-connections", "4"], "--l2-connections is a setting of the L2 tier (--l2)"),
        (["--l2-timeout-s", "1"], "--l2-timeout-s is a setting of the tiers below L1"),
        (["--l2-prefetch-max-chunks", "8"], "--l2-prefetch-max-chunks is a setting"),
        (["--l2-write-queue-objects", "8"], "--l2-write-queue-objects is a setting"),
    ],
)
def test_a_tier_setting_without_its_tier_is_refused(flags: list[str], needle: str) -> None:
    res = CliRunner().invoke(cli, [*SERVER, *flags])
    assert res.exit_code == EXIT_USAGE, res.output
    assert needle in res.output and f"or remove {flags[0]}" in res.output, res.output
    with pytest.raises(ConfigError, match="add --l2"):
        Config(l1_size_gb=0.25, **{flags[0][2:].replace("-", "_"): _typed(flags[1])}).check()


def _typed(value: str) -> Any:
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return value


def test_the_disk_tier_takes_the_settings_of_every_tier_but_not_redis_ones(
    tmp_path: Path,
) -> None:
    disk: dict[str, Any] = {"l1_size_gb": 0.25, "disk_dir": str(tmp_path), "disk_size_gb": 1.0}
    Config(**disk, l2_timeout_s=1.0, l2_prefetch_max_chunks=8).check()
    with pytest.raises(ConfigError, match="--l2-connections is a setting of the L2 tier"):
        Config(**disk, l2_connections=4).check()
