"""The command line as users run it: real processes, exit codes, messages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lmc_server.cli.main import cli
from lmc_server.config import Config, ConfigError, load_toml
from lmc_server.testing.process import ServerProcess, free_port


def lmcache(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmc_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_the_exact_production_command_line_starts_and_stops_cleanly() -> None:
    args = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
    srv = ServerProcess(args, l1_size_gb=1, backend="auto").start()
    try:
        out = lmcache("ping", "--port", str(srv.port))
        assert out.returncode == 0 and "ok: lmcache server" in out.stdout
        stats = lmcache("stats", "--json", "--port", str(srv.port))
        report = json.loads(stats.stdout)
        assert report["chunk_size"] == 256 and report["backend"] == "cpu"
        assert report["separate_object_groups"] and report["eviction_policy"] == "LRU"
        assert report["l1"]["capacity_bytes"] == 1 << 30
        human = lmcache("stats", "--port", str(srv.port))
        assert "L1:" in human.stdout and "chunk size 256" in human.stdout
    finally:
        assert srv.terminate(signal.SIGINT) == 0
    log = srv.log()
    assert "listening on" in log and "shutdown complete" in log and "Traceback" not in log


def test_sigterm_exits_zero() -> None:
    srv = ServerProcess().start()
    assert srv.terminate(signal.SIGTERM) == 0


def test_ping_without_server_exits_one() -> None:
    port = free_port()
    out = lmcache("ping", "--port", str(port), "--timeout-s", "0.3")
    assert out.returncode == 1 and "no server answered" in out.stderr, out.stderr
    assert f"tcp://127.0.0.1:{port}: nothing is listening" in out.stderr
    assert "CURVE" not in out.stderr, "no keys given and nothing listens: CURVE is not why"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--chunk-size", "0"], "chunk-size"),
        (["--eviction-policy", "MRU"], "eviction-policy"),
        (["--backend", "tpu"], "backend"),
        (["--port", "70000"], "port"),
        (["--l1-size-gb", "-1"], "l1-size-gb"),
        (["--l1-size-gb", "100000"], "does not fit this machine"),
    ],
)
def test_bad_flag_values_are_usage_errors(args: list[str], needle: str) -> None:
    out = lmcache("server", *args)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_help_shows_defaults_and_examples() -> None:
    out = CliRunner().invoke(cli, ["server", "--help"])
    assert out.exit_code == 0
    for needle in ("--separate-object-groups", "default: 256", "Examples:", "--l1-size-gb 100"):
        assert needle in out.output


def test_config_file_env_and_flags_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text('chunk-size = 512\nlease_ttl_s = 7.0\neviction-policy = "FIFO"\n')
    port = free_port()
    env = {"LMCACHE_CONFIG": str(cfg), "LMCACHE_LEASE_TTL_S": "9"}
    srv = ServerProcess(["--eviction-policy", "LRU"], port=port, env=env).start()
    try:
        report = json.loads(lmcache("stats", "--json", "--port", str(port)).stdout)
        assert report["chunk_size"] == 512  # file
        assert report["eviction_policy"] == "LRU"  # flag beats file
    finally:
        srv.terminate()
    assert "lease_ttl_s=9.0" in srv.log()  # environment beats file


def test_unknown_config_key_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("chunk_sise = 256\n")
    with pytest.raises(ConfigError, match="unknown setting 'chunk_sise'"):
        load_toml(str(cfg))
    out = lmcache("server", "--config", str(cfg))
    assert out.returncode == 2 and "chunk_sise" in out.stderr


def test_l1_larger_than_memory_is_refused_with_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"does not fit this machine: 16\.0 GiB"):
        Config(l1_size_gb=20).check(memory_bytes=16 << 30)
    Config(l1_size_gb=10).check(memory_bytes=16 << 30)


def test_port_in_use_is_a_clean_startup_failure() -> None:
    srv = ServerProcess().start()
    try:
        out = lmcache(
            "server",
            "--port",
            str(srv.port),
            "--l1-size-gb",
            "1",
            "--metrics-port",
            "0",
            "--backend",
            "cpu",
        )
        assert out.returncode == 3, out.stderr
        assert "startup failed" in out.stderr and "Traceback" not in out.stderr
    finally:
        srv.terminate()


def test_python_dash_m_is_the_same_program() -> None:
    out = lmcache("--version")
    assert out.returncode == 0 and "lmcache" in out.stdout
