"""CURVE for ``lmcache ping``/``stats`` (flags, environment,
TOML), the startup log's real L1 size, and a metrics port that clashes with nothing
common on a GPU host."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from lmc_server.cli.main import cli
from lmc_server.config import GIB, Config, default_l1_size_gb, load_toml
from lmc_server.testing.process import free_port

ROOT = Path(__file__).resolve().parents[2]


def _lmcache(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmc_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )


@dataclass
class CurveServer:
    port: int
    keys: Path


@pytest.fixture(scope="module")
def curve_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CurveServer]:
    """A CURVE server on loopback; plain clients get no answer from it."""
    d = tmp_path_factory.mktemp("curve")
    keys, clients = d / "keys", d / "clients"
    clients.mkdir()
    _lmcache("keygen", str(keys))
    _lmcache("keygen", str(keys), "--name", "ops")
    (clients / "ops.key").write_bytes((keys / "ops.key").read_bytes())
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmc_server",
            "server",
            "--port",
            str(port),
            "--backend",
            "cpu",
            "--l1-size-gb",
            "0.25",
            "--metrics-port",
            "0",
            "--curve-secret-key-file",
            str(keys / "server.key_secret"),
            "--curve-clients-dir",
            str(clients),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 20
        while "listening on" not in proc.stderr.readline():
            assert time.monotonic() < deadline and proc.poll() is None
        yield CurveServer(port, keys)
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
    assert proc.returncode == 0


def test_ping_and_stats_without_keys_fail_with_a_hint(curve_server: CurveServer) -> None:
    srv = curve_server
    out = _lmcache("ping", "--port", str(srv.port), "--timeout-s", "1")
    assert out.returncode == 1 and "--curve-server-key-file" in out.stderr


def test_ping_and_stats_with_curve_flags(curve_server: CurveServer) -> None:
    srv, keys = curve_server, curve_server.keys
    flags = [
        "--port",
        str(srv.port),
        "--curve-server-key-file",
        str(keys / "server.key"),
        "--curve-client-secret-key-file",
        str(keys / "ops.key_secret"),
    ]
    out = _lmcache("ping", *flags)
    assert out.returncode == 0 and out.stdout.startswith("ok: lmcache server"), out.stderr
    out = _lmcache("stats", "--json", *flags)
    assert out.returncode == 0 and '"backend": "cpu"' in out.stdout, out.stderr


def test_ping_with_curve_environment(curve_server: CurveServer) -> None:
    srv, keys = curve_server, curve_server.keys
    env = {
        "LMCACHE_PORT": str(srv.port),
        "LMCACHE_CURVE_SERVER_KEY_FILE": str(keys / "server.key"),
        "LMCACHE_CURVE_CLIENT_SECRET_KEY_FILE": str(keys / "ops.key_secret"),
    }
    out = _lmcache("ping", env=env)
    assert out.returncode == 0, out.stderr


def test_ping_and_stats_with_the_servers_toml(curve_server: CurveServer, tmp_path: Path) -> None:
    """One file for both: [server] as the server reads it, [client] for the commands."""
    srv, keys = curve_server, curve_server.keys
    toml = tmp_path / "server.toml"
    toml.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {srv.port}\n'
        f'curve_secret_key_file = "{keys / "server.key_secret"}"\n'
        f'curve_clients_dir = "{keys}"\n\n'
        f'[client]\ncurve-server-key-file = "{keys / "server.key"}"\n'
        f'curve_client_secret_key_file = "{keys / "ops.key_secret"}"\n'
    )
    assert load_toml(str(toml))["port"] == srv.port  # the server still reads this file
    for cmd in ("ping", "stats"):
        out = _lmcache(cmd, "--config", str(toml))
        assert out.returncode == 0, out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[client]\ncurve_key = "x"\n')
    out = _lmcache("ping", "--config", str(bad))
    assert out.returncode == 2 and "unknown [client] setting 'curve_key'" in out.stderr


def test_half_a_curve_pair_is_a_usage_error() -> None:
    out = _lmcache("ping", "--curve-server-key-file", "server.key")
    assert out.returncode == 2 and "needs both" in out.stderr


def test_startup_log_shows_the_l1_size_chosen_from_the_machine() -> None:
    """No --l1-size-gb: the log line says the size used, not 0.0 (null backend: no pool
    memory is allocated, so the machine default costs nothing here)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmc_server",
            "server",
            "--backend",
            "null",
            "--port",
            str(free_port()),
            "--metrics-port",
            "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = ""
        deadline = time.monotonic() + 20
        while "starting:" not in line:
            assert time.monotonic() < deadline
            line = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
    gb = float(re.search(r"l1_size_gb=([0-9.]+)", line).group(1))  # type: ignore[union-attr]
    want = default_l1_size_gb()
    assert gb == want > 0, line
    assert f"l1_size_bytes={int(want * GIB)}" in line


#: Ports of software commonly found on a GPU inference host.
COMMON_PORTS = {
    9090: "Prometheus",
    9091: "Pushgateway",
    9093: "Alertmanager",
    9100: "node_exporter",
    9400: "DCGM exporter",
    8000: "vLLM / Triton HTTP",
    8001: "Triton gRPC",
    8002: "Triton metrics",
    8080: "many",
    3000: "Grafana",
    5555: "lmcache server / DCGM hostengine",
    6379: "Redis",
    8265: "Ray",
    8888: "Jupyter",
    6006: "TensorBoard",
}


def test_default_metrics_port_clashes_with_nothing_common() -> None:
    port = Config().metrics_port
    assert port not in COMMON_PORTS, COMMON_PORTS.get(port)
    assert not 9100 <= port <= 9999, "Prometheus' exporter range is fully allocated"
    help_text = CliRunner().invoke(cli, ["server", "--help"]).output
    assert re.search(rf"--metrics-port.*default:\s+{port}", help_text, re.S)
    env = (ROOT / "deploy" / "lmcache-server.env").read_text()
    assert f"LMCACHE_METRICS_PORT={port}" in env
    prom = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert f"gpu-host-01:{port}" in prom and "9090" not in prom
    for doc in ("operations.md", "security.md"):
        text = (ROOT / "docs" / doc).read_text()
        assert str(port) in text and ":9090" not in text
