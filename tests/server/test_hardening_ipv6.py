"""IPv6 for the server, the clients, the connector's endpoint and
/metrics, with the loopback-only rule (``::1`` is loopback; ``::`` needs CURVE)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import urllib.request

import pytest

from lmc_server.client import Client
from lmc_server.client.aio import AsyncClient
from lmc_server.config import Config, ConfigError
from lmc_server.integration.settings import ConnectorSettings
from lmc_server.net import address_family, is_loopback, tcp_endpoint
from lmc_server.testing.process import ServerProcess, free_port


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(
    not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)"
)


def _ipv6_only_name() -> str | None:
    """A host name this machine resolves to ::1 only (``ip6-localhost`` on Debian)."""
    for name in ("ip6-localhost", "ip6-loopback", "localhost6"):
        try:
            addrs = {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            continue
        if addrs == {"::1"}:
            return name
    return None


def test_endpoints_bracket_ipv6_literals_once() -> None:
    assert tcp_endpoint("::1", 5) == "tcp://[::1]:5"
    assert tcp_endpoint("[::1]", 5) == "tcp://[::1]:5"
    assert tcp_endpoint("127.0.0.1", 5) == "tcp://127.0.0.1:5"
    assert tcp_endpoint("localhost", 5) == "tcp://localhost:5"
    assert Config(host="[::1]").endpoint == "tcp://[::1]:5555"


def _fake_resolver(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    def resolve(host: str, *_: object) -> list[tuple[object, ...]]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, 0, 0, "", (a, 0)) for a in table[host]
        ]

    return resolve


def test_loopback_rule_resolves_names() -> None:
    r = _fake_resolver(
        {
            "v6only": ["::1"],
            "both": ["127.0.0.1", "::1"],
            "public6": ["2001:db8::1"],
            "mixed": ["::1", "10.0.0.1"],
        }
    )
    assert is_loopback("::1", r) and is_loopback("[::1]", r) and is_loopback("127.0.0.2", r)
    assert is_loopback("v6only", r) and is_loopback("both", r)
    assert not is_loopback("public6", r) and not is_loopback("mixed", r)
    assert not is_loopback("::", r) and not is_loopback("[::]", r) and not is_loopback("*", r)
    assert not is_loopback("nowhere", r)
    assert address_family("v6only", r) == socket.AF_INET6
    assert address_family("[::1]", r) == socket.AF_INET6
    assert address_family("both", r) == socket.AF_INET


@pytest.mark.parametrize("host", ["::", "[::]"])
def test_ipv6_any_address_needs_curve(host: str) -> None:
    with pytest.raises(ConfigError, match="refusing to listen"):
        Config(host=host, l1_size_gb=1).check()


def test_unresolvable_host_is_a_usage_error() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmc_server",
            "server",
            "--host",
            "no-such-host.invalid",
            "--l1-size-gb",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "does not resolve" in out.stderr


@needs_ipv6
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_server_clients_cli_and_metrics_on_ipv6_loopback(host: str) -> None:
    metrics_port = free_port()
    with ServerProcess(
        ["--metrics-host", host], host=host, l1_size_gb=0.25, metrics_port=metrics_port
    ) as srv:
        assert srv.endpoint.startswith("tcp://[::1]:")
        with Client(srv.endpoint, client_name="v6") as c:
            assert c.stats().backend == "cpu"

        async def aio() -> str:
            async with await AsyncClient.connect(srv.endpoint) as ac:
                return (await ac.ping()).server_version

        assert asyncio.run(aio())
        # the connector builds its endpoint from host and port
        for h in ("::1", "[::1]"):
            settings = ConnectorSettings(host=h, port=srv.port)
            assert settings.endpoint == f"tcp://[::1]:{srv.port}"
            with Client(settings.endpoint) as c:
                assert c.ping().server_version
        for cmd in ("ping", "stats"):
            out = subprocess.run(
                [sys.executable, "-m", "lmc_server", cmd, "--host", host, "--port", str(srv.port)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
        with urllib.request.urlopen(f"http://[::1]:{metrics_port}/healthz", timeout=10) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://[::1]:{metrics_port}/metrics", timeout=10) as r:
            assert b"lmcache_" in r.read()
        assert "listening on tcp://[::1]:" in srv.log()


@needs_ipv6
def test_host_name_resolving_to_ipv6() -> None:
    name = _ipv6_only_name()
    if name is None:
        pytest.skip(
            "no host name resolves to ::1 only on this machine (/etc/hosts has no "
            "ip6-localhost); the rule itself is covered with a fake resolver"
        )
    with (
        ServerProcess(
            ["--metrics-host", name], host=name, l1_size_gb=0.25, metrics_port=free_port()
        ) as srv,
        Client(srv.endpoint) as c,
    ):
        assert c.ping().server_version
