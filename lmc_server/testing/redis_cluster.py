"""Run a throwaway Redis Cluster of ``redis-server`` processes on loopback (tests, benchmarks).

    with RedisClusterProcess(3) as c:
        url = c.url  # redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3

Each node is a :class:`~lmc_server.testing.redis_process.RedisProcess` with
``cluster-enabled yes`` (its ``nodes.conf`` in its own temporary folder); the cluster is
made with ``redis-cli --cluster create ... --cluster-yes`` (primaries only, the 16,384
slots split evenly) and is ready once every node reports ``cluster_state:ok``.
:meth:`stop_node` / :meth:`start_node` kill a node and bring it back (its
``nodes.conf`` kept, so it rejoins with its slots, empty); :meth:`move_slots` migrates
slots with their keys from one node to another (``redis-cli --cluster reshard``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from typing import Any

from lmc_server.testing.process import free_port
from lmc_server.testing.redis_process import RedisProcess

#: A node's cluster bus listens this far above its port (Redis' fixed rule).
BUS_PORT_OFFSET = 10_000
#: How long a node may be silent before the others mark it failed (Redis: 15 s).
NODE_TIMEOUT_MS = 1000


def _cluster_port() -> int:
    """A free loopback port whose cluster bus port (10,000 higher) is free too."""
    while True:
        port = free_port()
        if port > 65535 - BUS_PORT_OFFSET:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + BUS_PORT_OFFSET))
            except OSError:
                continue
        return port


def redis_cli_path() -> str | None:
    return shutil.which("redis-cli")


class RedisClusterProcess:
    def __init__(self, nodes: int = 3, exe: str | None = None, io_threads: int = 1) -> None:
        cli = redis_cli_path()
        if cli is None:
            raise FileNotFoundError(
                "redis-cli is not installed (Debian: apt-get install redis-tools)"
            )
        self.cli = cli
        extra = (
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--cluster-require-full-coverage",
            "yes",
        )
        self.nodes = [
            RedisProcess(port=_cluster_port(), extra=extra, exe=exe, io_threads=io_threads)
            for _ in range(nodes)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = 30.0) -> RedisClusterProcess:
        for n in self.nodes:
            n.start()
        out = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if out.returncode != 0:
            self.close()
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        self.wait_ok(timeout_s)
        return self

    def info(self, i: int) -> dict[str, str]:
        with self.nodes[i].client() as c:
            raw = c.execute_command("CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def wait_ok(self, timeout_s: float = 30.0, nodes: list[int] | None = None) -> None:
        """Until every node (of ``nodes``) says ``cluster_state:ok``."""
        t0 = time.monotonic()
        for i in nodes if nodes is not None else range(len(self.nodes)):
            while True:
                try:
                    if self.info(i).get("cluster_state", "").strip() == "ok":
                        break
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"cluster node {i} not ok after {timeout_s} s")
                time.sleep(0.05)

    def node_id(self, i: int) -> str:
        with self.nodes[i].client() as c:
            raw = c.execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def stop_node(self, i: int) -> None:
        self.nodes[i].kill()

    def start_node(self, i: int) -> None:
        self.nodes[i].start()

    def move_slots(self, src: int, dst: int, slots: int, timeout_s: float = 120.0) -> str:
        """Migrate ``slots`` slots (and their keys) from node ``src`` to ``dst``."""
        out = subprocess.run(
            [
                self.cli,
                "--cluster",
                "reshard",
                f"127.0.0.1:{self.nodes[0].port}",
                "--cluster-from",
                self.node_id(src),
                "--cluster-to",
                self.node_id(dst),
                "--cluster-slots",
                str(slots),
                "--cluster-yes",
                "--cluster-pipeline",
                "4",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster reshard failed: {out.stdout}{out.stderr}")
        return out.stdout

    def keys(self) -> int:
        total = 0
        for n in self.nodes:
            if n.proc is not None:
                with n.client() as c:
                    total += int(c.dbsize())
        return total

    def close(self) -> None:
        for n in self.nodes:
            n.close()

    def __enter__(self) -> RedisClusterProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
