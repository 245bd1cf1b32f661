"""Run a throwaway ``redis-server`` on a free loopback port (tests, benchmarks).

    with RedisProcess() as r:
        url = r.url  # redis://127.0.0.1:PORT/0

No persistence (``save ""``, no AOF), its files in a temporary folder, bound to
127.0.0.1 only. ``io_threads`` > 1 starts it with Redis 6+'s I/O threads
(``--io-threads N --io-threads-do-reads yes``: sockets read and written on N threads,
commands still run on one). :meth:`kill` and :meth:`start` again (same port) simulate the store
dying and coming back empty.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from typing import IO, Any

from lmc_server.testing.process import free_port


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def server_version(exe: str) -> str:
    """What ``exe --version`` prints (``Redis server v=7.0.15 ...``,
    ``Valkey server v=8.0.1 ...``), for a benchmark's report."""
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() or out.stderr.strip()


class RedisProcess:
    def __init__(
        self,
        port: int | None = None,
        maxmemory_mb: int = 0,
        policy: str = "allkeys-lru",
        extra: tuple[str, ...] = (),
        password: str | None = None,
        tls_dir: str | None = None,
        io_threads: int = 1,
        exe: str | None = None,
    ) -> None:
        """``tls_dir`` holds ca.crt, server.crt and server.key: TLS only (no plain
        port); ``password`` sets ``requirepass``; ``exe`` is the server binary
        (``valkey-server`` takes the same arguments) [default: redis-server on PATH]."""
        exe = exe or redis_server_path()
        if exe is None:
            raise FileNotFoundError(
                "redis-server is not installed (Debian: apt-get install "
                "redis-server; CI: .ci/install-redis.sh)"
            )
        self.exe = exe
        self.port = port or free_port()
        self.maxmemory_mb = maxmemory_mb
        self.policy = policy
        self.extra = extra
        self.password = password
        self.tls_dir = tls_dir
        self.io_threads = io_threads
        self._dir = tempfile.TemporaryDirectory(prefix="lmc-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls_dir:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls_dir}/ca.crt"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        import redis

        args = [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self._dir.name,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--maxmemory-policy",
            self.policy,
            "--maxmemory",
            f"{self.maxmemory_mb}mb",
            *self.extra,
        ]
        if self.io_threads > 1:
            args += ["--io-threads", str(self.io_threads), "--io-threads-do-reads", "yes"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls_dir:
            args[1:3] = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                f"{self.tls_dir}/server.crt",
                "--tls-key-file",
                f"{self.tls_dir}/server.key",
                "--tls-ca-cert-file",
                f"{self.tls_dir}/ca.crt",
                "--tls-auth-clients",
                "no",
            ]
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while True:
            try:
                with self.client() as c:
                    c.ping()
                return self
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                    log = self.log()
                    self.kill()
                    raise RuntimeError(
                        f"redis-server did not start on {self.port}: {log}"
                    ) from None
                time.sleep(0.05)

    def client(self) -> Any:
        """A synchronous redis-py client of this instance."""
        import redis

        return redis.Redis.from_url(self.url, password=self.password, socket_timeout=5)

    def log(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.kill()
        self._dir.cleanup()

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
