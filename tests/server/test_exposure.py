"""Exposure and limits: loopback by default, ipc permissions, CURVE, per-client limits."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth

from lmc_server.client import Client, CurveKeys, chunk_digests
from lmc_server.client.aio import AsyncClient
from lmc_server.config import Config, ConfigError
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess, free_port


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "*"])
def test_non_loopback_bind_refused_without_curve(host: str) -> None:
    with pytest.raises(ConfigError, match="refusing to listen"):
        Config(host=host, l1_size_gb=1).check()
    out = subprocess.run(
        [sys.executable, "-m", "lmc_server", "server", "--host", host, "--l1-size-gb", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "refusing to listen" in out.stderr


def test_loopback_addresses_are_allowed() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        Config(host=host, l1_size_gb=1).check()


def test_curve_needs_both_halves() -> None:
    with pytest.raises(ConfigError, match="both"):
        Config(host="0.0.0.0", curve_secret_key_file="x", l1_size_gb=1).check()


def test_ipc_socket_lives_in_a_private_folder(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "lmcache" / "server.sock"
    with ServerProcess(["--ipc-path", str(sock)]) as srv:
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        with Client(f"ipc://{sock}") as c:
            assert c.ping().server_version
            assert c.stats().backend == "cpu"
        assert srv.proc is not None


def test_curve_admits_only_known_clients(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    clients.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "lmc_server", "keygen", str(keys)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "server.key_secret" in out.stdout
    assert stat.S_IMODE(os.stat(keys / "server.key_secret").st_mode) == 0o600
    subprocess.run(
        [sys.executable, "-m", "lmc_server", "keygen", str(keys), "--name", "engine"],
        check=True,
        capture_output=True,
    )
    (clients / "engine.key").write_bytes((keys / "engine.key").read_bytes())
    port = free_port()
    args = [
        "--host",
        "0.0.0.0",
        "--curve-secret-key-file",
        str(keys / "server.key_secret"),
        "--curve-clients-dir",
        str(clients),
    ]
    srv = ServerProcess(args, port=port)
    srv.endpoint = f"tcp://127.0.0.1:{port}"
    server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
    client_public, client_secret = zmq.auth.load_certificate(str(keys / "engine.key_secret"))
    assert client_secret is not None
    stranger_public, stranger_secret = zmq.curve_keypair()

    def ping(public: bytes, secret: bytes) -> bool:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.curve_serverkey = server_public
        s.curve_publickey = public
        s.curve_secretkey = secret
        s.connect(srv.endpoint)
        s.send(encode(m.Ping(req_id=1)))
        ok = bool(s.poll(1500)) and isinstance(decode_reply(s.recv()), m.Pong)
        s.close(linger=0)
        ctx.term()
        return ok

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
            "1",
            "--metrics-port",
            "0",
            *args,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(100):
            if ping(client_public, client_secret):
                break
        else:
            raise AssertionError("CURVE client with a known key got no answer")
        assert not ping(stranger_public, stranger_secret), "unknown key admitted"
        curve = CurveKeys.load(str(keys / "server.key"), str(keys / "engine.key_secret"))
        with Client(srv.endpoint, curve=curve) as ok:
            assert ok.stats().backend == "cpu"
        with Client(srv.endpoint, timeout_s=1.5, hello=False) as plain:
            with pytest.raises(TimeoutError):
                plain.ping()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err


def test_in_flight_limit_answers_busy_and_keeps_serving() -> None:
    async def main(endpoint: str) -> list[object]:
        async with await AsyncClient.connect(endpoint) as c:
            with ShmKV(simple_model(layers=8, bytes_per_token=2048, num_blocks=256)) as kv:
                kv.fill_random(1)
                reg = await c.register(**kv.register_kwargs())
                calls = [
                    c.store(reg, chunk_digests(np.full(256 * 8, i), 256), block_ids_for(reg, 8))
                    for i in range(12)
                ]
                results = await asyncio.gather(*calls, return_exceptions=True)
                assert (await c.ping()).server_version
                return list(results)

    with ServerProcess(["--max-inflight-per-client", "2"]) as srv:
        results = asyncio.run(main(srv.endpoint))
    busy = [r for r in results if isinstance(r, Exception)]
    assert busy and all("busy" in str(e) for e in busy), results
    assert any(not isinstance(r, Exception) for r in results)


def test_peer_that_never_says_hello_is_ignored_after_a_few_messages() -> None:
    with ServerProcess() as srv:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(srv.endpoint)
        for i in range(40):
            s.send(encode(m.Stats(req_id=i + 1)))
        answered = 0
        while s.poll(500):
            reply = decode_reply(s.recv())
            assert isinstance(reply, m.Error) and reply.code == "handshake"
            answered += 1
        assert answered == 16
        s.close(linger=0)
        ctx.term()
        with Client(srv.endpoint) as c:
            assert c.ping().server_version
