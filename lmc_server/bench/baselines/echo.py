"""The latency baseline: a plain pyzmq ROUTER that sends every message straight back.

It runs as its own process (``python -m lmc_server.bench.baselines.echo PORT``) on the same
transport as the server, so ``ours / echo`` isolates what the server adds on top of
zmq and Python: decoding, dispatch, the handler and encoding the reply.
"""

from __future__ import annotations

import subprocess
import sys
import time
from types import TracebackType

import zmq

from lmc_server.testing.process import free_port


def serve(port: int) -> None:
    """Echo until SIGTERM/SIGINT (the default handlers end the process)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt(zmq.RCVHWM, 10000)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


class EchoServer:
    """The echo process; ``endpoint`` answers once :meth:`start` returns."""

    def __init__(self, timeout_s: float = 20.0) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EchoServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmc_server.bench.baselines.echo", str(self.port)]
        )
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            deadline = time.monotonic() + self.timeout_s
            while True:
                sock.send(b"ready?")
                if sock.poll(100):
                    sock.recv()
                    return self
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the pyzmq echo server did not start")
        finally:
            sock.close(linger=0)
            ctx.term()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> EchoServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


if __name__ == "__main__":
    try:
        serve(int(sys.argv[1]))
    except KeyboardInterrupt:
        pass
