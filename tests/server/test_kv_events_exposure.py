"""The KV-event endpoints follow the server's exposure rule (``Config.exposed``).

The stream carries the prompts' tokens. A KV-event socket the server binds (the
publisher under vLLM's rule: a wildcard or ipc endpoint; the replay endpoint always) on
an address other machines can reach is refused, exactly where ``--host`` is, unless
CURVE is on (the event sockets then admit only the server's CURVE clients) or
``--kv-events-allow-remote`` says so; an endpoint that is connected to (a router's
bound SUB) is allowed. The log says which it is: "binding" or "connecting to".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from lmc_server.config import Config, ConfigError
from lmc_server.testing.process import ServerProcess, free_port

FIX = "--kv-events-allow-remote"


def refusal(**fields: Any) -> str | None:
    try:
        Config(l1_size_gb=1, **fields).check()
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "fields",
    [
        {"kv_events_endpoint": "tcp://*:5557"},
        {"kv_events_endpoint": "tcp://[::]:5557"},
        {"kv_events_endpoint": "ipc:///tmp/e", "kv_events_replay_endpoint": "tcp://*:5558"},
        {"kv_events_endpoint": "ipc:///tmp/e", "kv_events_replay_endpoint": "tcp://0.0.0.0:5558"},
        {"kv_events_endpoint": "ipc:///tmp/e", "kv_events_replay_endpoint": "tcp://10.1.2.3:5558"},
    ],
)
def test_a_non_loopback_bind_is_refused_naming_the_fixes(fields: dict[str, str]) -> None:
    message = refusal(**fields)
    assert message is not None and message.startswith("refusing to bind")
    assert "prompts' tokens" in message
    for fix in (FIX, "--curve-secret-key-file", "tcp://ROUTER:PORT", "loopback"):
        assert fix in message


def test_a_publisher_connecting_to_0000_is_refused() -> None:
    message = refusal(kv_events_endpoint="tcp://0.0.0.0:5557")
    assert message is not None and "write tcp://*:PORT" in message


@pytest.mark.parametrize(
    "fields",
    [
        {"kv_events_endpoint": "ipc:///tmp/e", "kv_events_replay_endpoint": "ipc:///tmp/r"},
        {"kv_events_endpoint": "tcp://[::1]:5557", "kv_events_replay_endpoint": "tcp://[::1]:58"},
        {"kv_events_endpoint": "ipc:///tmp/e", "kv_events_replay_endpoint": "tcp://127.0.0.1:1"},
        {"kv_events_endpoint": "tcp://10.1.2.3:5557"},  # connected to: the router's address
        {"kv_events_endpoint": "tcp://*:5557", "kv_events_allow_remote": True},
        {
            "kv_events_endpoint": "tcp://*:5557",
            "kv_events_replay_endpoint": "tcp://0.0.0.0:5558",
            "kv_events_allow_remote": True,
        },
        {
            "kv_events_endpoint": "tcp://*:5557",
            "curve_secret_key_file": "server.key_secret",
            "curve_clients_dir": "clients",
        },
    ],
)
def test_loopback_connected_curve_or_allowed_binds_pass(fields: dict[str, Any]) -> None:
    assert refusal(**fields) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "localhost", "0.0.0.0", "*", "10.1.2.3"])
@pytest.mark.parametrize("curve", [False, True])
def test_the_rule_is_the_one_for_the_servers_host(host: str, curve: bool) -> None:
    """Refused for the replay endpoint (always bound) exactly when ``--host`` is."""
    keys = {"curve_secret_key_file": "k", "curve_clients_dir": "d"} if curve else {}
    bare = host.strip("[]")
    host_refused = refusal(host=bare, **keys)
    events_refused = refusal(
        kv_events_endpoint="ipc:///tmp/e",
        kv_events_replay_endpoint=f"tcp://{host}:5558",
        **keys,
    )
    assert (host_refused is None) == (events_refused is None), (host_refused, events_refused)


def test_the_server_refuses_to_start_and_says_why() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmc_server",
            "server",
            "--l1-size-gb",
            "0.25",
            "--kv-events-endpoint",
            f"tcp://*:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "refusing to bind --kv-events-endpoint" in out.stderr
    assert FIX in out.stderr


def first_batch(sub: zmq.Socket[Any], timeout_ms: int) -> list[bytes] | None:
    if not sub.poll(timeout_ms):
        return None
    return sub.recv_multipart()


def test_an_allowed_wildcard_is_bound_and_logged_so() -> None:
    port = free_port()
    args = ["--kv-events-endpoint", f"tcp://*:{port}", FIX, "--kv-events-topic", "t@"]
    with ServerProcess(args, l1_size_gb=0.25) as srv:
        assert f"publishing KV events: binding tcp://*:{port} (replay off" in srv.log()
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port}")
            assert sub.poll(100) == 0  # reachable: the socket is bound (nothing sent yet)
        finally:
            ctx.destroy(linger=0)


def test_a_connected_endpoint_is_logged_so() -> None:
    port = free_port()
    with ServerProcess(["--kv-events-endpoint", f"tcp://127.0.0.1:{port}"], l1_size_gb=0.25) as s:
        assert f"publishing KV events: connecting to tcp://127.0.0.1:{port}" in s.log()


def test_with_curve_a_wildcard_admits_only_the_servers_clients(tmp_path: Path) -> None:
    """The bound event sockets are CURVE servers with the server's key, admitting the
    certificates of ``--curve-clients-dir``: a known client receives the stream and
    replays; a stranger and a plain subscriber get nothing."""
    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_public_file, server_secret_file = zmq.auth.create_certificates(str(keys), "server")
    client_public_file, client_secret_file = zmq.auth.create_certificates(str(keys), "router")
    (clients / "router.key").write_bytes(Path(client_public_file).read_bytes())
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    client_public, client_secret = zmq.auth.load_certificate(client_secret_file)
    assert client_secret is not None
    stranger_public, stranger_secret = zmq.curve_keypair()
    port, replay_port = free_port(), free_port()
    args = [
        *("--host", "0.0.0.0", "--port", str(free_port()), "--metrics-port", "0"),
        *("--l1-size-gb", "0.25"),
        *("--curve-secret-key-file", server_secret_file, "--curve-clients-dir", str(clients)),
        *("--kv-events-endpoint", f"tcp://*:{port}", "--kv-events-topic", "t@"),
        *("--kv-events-replay-endpoint", f"tcp://0.0.0.0:{replay_port}"),
    ]
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmc_server", "server", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            log = []
            for line in proc.stderr:  # the server's own socket needs CURVE: read its log
                log.append(line)
                if "listening on" in line:
                    break
            else:
                raise AssertionError(f"the server did not start: {''.join(log)}")
            (published,) = [x for x in log if "publishing KV events" in x]
            assert f"binding tcp://*:{port} with CURVE" in published
            assert f"bound on tcp://0.0.0.0:{replay_port}" in published

            def replays(public: bytes | None, secret: bytes | None) -> bool:
                req = ctx.socket(zmq.DEALER)
                req.setsockopt(zmq.LINGER, 0)
                if public is not None and secret is not None:
                    req.curve_serverkey = server_public
                    req.curve_publickey = public
                    req.curve_secretkey = secret
                req.connect(f"tcp://127.0.0.1:{replay_port}")
                req.send_multipart([b"", (0).to_bytes(8, "big")])
                ok = bool(req.poll(1500))
                req.close(linger=0)
                return ok

            assert replays(client_public, client_secret)  # AllBlocksCleared, seq 0
            assert not replays(stranger_public, stranger_secret)
            assert not replays(None, None)
        finally:
            proc.terminate()
            proc.wait(30)
            if proc.stderr is not None:
                proc.stderr.close()
    finally:
        ctx.destroy(linger=0)
