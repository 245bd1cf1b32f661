"""No L2 credential ever accepted or shown, every setting accepted in
the TOML file under its flag's name, no traceback for a mistyped host or port.

Real ``lmcache`` processes throughout: what a user types is what is tested, with the
``LMCACHE_*`` variables of the test's own environment removed so that only the test's
settings apply.
"""

from __future__ import annotations

import grp
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest

from lmc_server.cli.main import cli
from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess, free_port
from lmc_server.tiers.url import redact_url

SECRET = "hunter2-Zq9"
#: A server that starts in a blink: a small pool, no metrics endpoint.
SMALL = [
    "--backend",
    "cpu",
    "--l1-size-gb",
    "0.0625",
    "--slab-size-mb",
    "16",
    "--metrics-port",
    "0",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    return {**env, **extra}


def lmcache(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmc_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env or _env(),
    )


def assert_usage_error(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, one ``Error:`` line, no traceback; returns that line."""
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# -- item 1: L2 credentials ------------------------------------------------------------

#: Every form that hands redis-py (or Mooncake) a credential through the URL.
CREDENTIAL_URLS = [
    f"redis://:{SECRET}@127.0.0.1:6379/0",
    f"redis://127.0.0.1:6379/0?password={SECRET}",
    f"redis://127.0.0.1:6379/0?db=0&username=lmcache&password={SECRET}",
    f"redis://127.0.0.1:6379/0?pass%77ord={SECRET}",  # percent-encoded: redis-py decodes
    f"rediss://127.0.0.1:6380/0?ssl_keyfile=/k.pem&ssl_password={SECRET}",
    f"mooncake://127.0.0.1:50051?metadata=http://u:{SECRET}@127.0.0.1:8080/metadata",
]


@pytest.mark.parametrize("url", CREDENTIAL_URLS)
def test_a_credential_on_the_command_line_is_refused_and_never_echoed(url: str) -> None:
    res = lmcache("server", *SMALL, "--port", str(free_port()), "--l2", url)
    assert_usage_error(res, "credential", "LMCACHE_L2_PASSWORD", "--l2-password-file")
    assert SECRET not in res.stdout + res.stderr


@pytest.mark.parametrize("url", CREDENTIAL_URLS[1:3])
def test_a_credential_in_the_config_file_or_environment_is_refused(
    url: str, tmp_path: Path
) -> None:
    toml = tmp_path / "server.toml"
    toml.write_text(f'l2 = "{url}"\nl2_timeout_s = 0.5\n')
    by_file = lmcache("server", *SMALL, "--port", str(free_port()), "--config", str(toml))
    by_env = lmcache("server", *SMALL, "--port", str(free_port()), env=_env(LMCACHE_L2=url))
    for res in (by_file, by_env):
        assert_usage_error(res, "credential", "LMCACHE_L2_PASSWORD")
        assert SECRET not in res.stdout + res.stderr


def test_a_query_parameter_redis_py_does_not_know_stops_the_start() -> None:
    """redis-py makes every query parameter a keyword of its connections; one it does
    not know would kill the tier's background task silently (L2 never connected), so
    the server refuses it at start."""
    res = lmcache(
        "server",
        *SMALL,
        "--port",
        str(free_port()),
        "--l2",
        f"redis://127.0.0.1:{free_port()}/0?frobnicate=1",
    )
    out = res.stdout + res.stderr
    assert res.returncode == 3, out
    assert "startup failed" in out and "frobnicate" in out and "Traceback" not in out


def test_the_url_is_shown_without_credential_parts_and_the_server_serves(tmp_path: Path) -> None:
    """Defence in depth: a URL that is accepted (a user name, a query value holding an
    ``@``) is still shown only through the redaction, in stats, /healthz, /metrics and
    the log; the server serves from L1 while L2 is unreachable."""
    dead, metrics = free_port(), free_port()
    url = f"redis://lmcache@127.0.0.1:{dead}/0?client_name=kv@{SECRET}"
    shown = f"redis://lmcache@127.0.0.1:{dead}/0?client_name=***"
    assert redact_url(url) == shown
    with (
        ServerProcess(
            ["--l2", url, "--l2-timeout-s", "0.5", "--slab-size-mb", "16"],
            l1_size_gb=0.0625,
            metrics_port=metrics,
            env=_env(),
        ) as srv,
        ShmKV(simple_model()) as kv,
    ):
        stats = lmcache("stats", "--port", str(srv.port), "--json")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["l2"]["url"] == shown
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/healthz") as h:
            health = h.read().decode()
        assert shown in health, health
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics") as h:
            body = h.read().decode()
        kv.fill_random(1)
        with Client(srv.endpoint) as c:
            reg = c.register(**kv.register_kwargs())
            digests = chunk_digests(np.arange(256), 256)
            assert c.store(reg, digests, block_ids_for(reg, 1)).ok.all()
            assert c.lookup(reg, digests, lease=False).hit_chunks == 1
        log = srv.log()
    for text in (stats.stdout, health, body, log):
        assert SECRET not in text
    assert f"l2_url='{shown}'" in log  # the startup line


# -- item 2: every flag is a TOML key --------------------------------------------------


def _server_options() -> list[click.Option]:
    command = cli.commands["server"]
    return [
        p
        for p in command.params
        if isinstance(p, click.Option) and p.name not in (None, "help") and "--config" not in p.opts
    ]


def _flag_name(opt: click.Option) -> str:
    """``--l2`` -> ``l2``; ``--memory-check/--no-memory-check`` -> ``memory-check``."""
    return max((o for o in opt.opts if o.startswith("--")), key=len)[2:]


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _logged(value: Any) -> str:
    """How the startup line shows a value (``server._describe``)."""
    return repr(value) if isinstance(value, str) else str(value)


def test_every_flag_is_accepted_in_the_config_file_under_its_name(tmp_path: Path) -> None:
    """Each setting under its flag's name (``l2``, ``chunk-size``, ...) in one TOML file,
    read by a real server; the startup line shows every value took effect. A flag this
    test has no value for is written with its default (still checked as a key)."""
    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    clients.mkdir()
    assert lmcache("keygen", str(keys)).returncode == 0
    pw = tmp_path / "l2-password"
    pw.write_text("pw\n")
    log_file = tmp_path / "server.log"
    port = free_port()
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "chunk_size": 512,
        "separate_object_groups": True,
        "l1_size_gb": 0.0625,
        "eviction_policy": "ARC",
        "backend": "cpu",
        "log_level": "DEBUG",
        "log_format": "text",
        "log_file": str(log_file),
        "lease_ttl_s": 12.5,
        "slab_size_mb": 16,
        "copy_threads": 1,
        "cuda_copy_mode": "mapped",
        "max_frame_bytes": 131072,
        "drain_timeout_s": 3.5,
        "metrics_port": free_port(),
        "metrics_host": "localhost",
        "heartbeat_timeout_s": 5.5,
        "max_inflight_per_client": 8,
        "ipc_path": str(tmp_path / "ipc" / "sock"),
        "ipc_group": grp.getgrgid(os.getgid()).gr_name,
        "curve_secret_key_file": str(keys / "server.key_secret"),
        "curve_clients_dir": str(clients),
        "memory_check": False,
        "l2_url": f"redis://127.0.0.1:{free_port()}/0",
        "l2_password_file": str(pw),
        "l2_write_queue_objects": 100,
        "l2_prefetch_max_chunks": 10,
        "l2_timeout_s": 0.5,
    }
    lines, expect = [], []
    for opt in _server_options():
        assert opt.name is not None
        value = values.get(opt.name, opt.default)
        assert value is not None, f"no value for --{_flag_name(opt)}: add one to this test"
        lines.append(f"{_flag_name(opt)} = {_toml(value)}")
        expect.append(f"{opt.name}={_logged(value)}")
    assert "l2 = " in "\n".join(lines)  # the flag's name, not the field's (l2_url)
    toml = tmp_path / "server.toml"
    toml.write_text("\n".join(lines) + "\n")
    errors = tmp_path / "stderr"
    with errors.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmc_server", "server", "--config", str(toml)],
            env=_env(),
            stdout=err,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in (log_file.read_text() if log_file.exists() else ""):
            assert proc.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    starting = next(line for line in log_file.read_text().splitlines() if "starting:" in line)
    missing = [e for e in expect if f" {e} " not in f" {starting} "]
    assert not missing, (missing, starting)


def test_a_setting_named_twice_in_the_config_file_is_refused(tmp_path: Path) -> None:
    toml = tmp_path / "server.toml"
    toml.write_text('l2 = "redis://127.0.0.1:1/0"\nl2_url = "redis://127.0.0.1:2/0"\n')
    res = lmcache("server", *SMALL, "--config", str(toml))
    assert_usage_error(res, "l2_url", "given already")


# -- item 3: a mistyped host or port is a one-line usage error -------------------------

BAD_HOSTS = ["*", "a b", "[::1", "::1]", "tcp://127.0.0.1", ""]
BAD_PORTS = ["abc", "70000", "-1"]
#: Options that need a value alongside (the server's bad ports must be the ones refused).
COMMAND_ARGS = {
    "server": [*SMALL[:6], "--port", str(free_port())],
    "ping": ["--timeout-s", "0.2"],
    "stats": ["--timeout-s", "0.2"],
}


def _address_options() -> list[tuple[str, str, list[str]]]:
    """(command, option, malformed values) for every host and port option of the CLI."""
    out = []
    for name, command in cli.commands.items():
        for p in command.params:
            if not isinstance(p, click.Option) or p.name is None:
                continue
            flag = max(p.opts, key=len)
            if p.name.endswith("host"):
                out.append((name, flag, BAD_HOSTS))
            elif p.name.endswith("port"):
                out.append((name, flag, BAD_PORTS))
    return out


def test_every_host_and_port_option_is_found() -> None:
    found = {(c, o) for c, o, _ in _address_options()}
    assert {
        ("ping", "--host"),
        ("stats", "--port"),
        ("server", "--metrics-host"),
        ("server", "--metrics-port"),
    } <= found, found
    assert {c for c, _ in found} <= set(COMMAND_ARGS), found


@pytest.mark.parametrize("command,option,bad", _address_options())
def test_a_malformed_host_or_port_is_a_usage_error_without_traceback(
    command: str, option: str, bad: list[str]
) -> None:
    for value in bad:
        if command == "server" and option == "--host" and value == "*":
            continue  # every address: refused as not loopback, tested elsewhere
        res = lmcache(command, *COMMAND_ARGS[command], f"{option}={value}")
        line = assert_usage_error(res)
        assert option in line or "host" in line or "port" in line, line


def test_keygen_into_an_unwritable_place_is_a_usage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_usage_error(lmcache("keygen", str(blocker / "keys")), "cannot write keys")
