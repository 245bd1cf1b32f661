"""A server on one port across restarts, for tests of what survives them.

:class:`RestartingServer` restarts its server three ways, the ones a connector meets:
``terminated`` (SIGTERM, drained, started again), ``killed`` (SIGKILL, started again)
and ``down`` (SIGKILL, started again :data:`DOWN_S` later on a thread, so that the
next request arrives while nothing listens). ``pids`` lists every server process it
started, for checks of what they left behind.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from lmc_server.testing.process import ServerProcess

#: How long the server stays down in the ``down`` restart.
DOWN_S = 1.0
HOW = ("terminated", "killed", "down")


class RestartingServer:
    def __init__(
        self,
        args: Sequence[str],
        backend: str = "cpu",
        l1_size_gb: float = 0.25,
        start_timeout_s: float = 20.0,
    ) -> None:
        self._args = list(args)
        self._backend = backend
        self._l1_size_gb = l1_size_gb
        self._start_timeout_s = start_timeout_s
        self.current = self._server(port=None).start()
        self.pids = [self._pid()]
        self._starter: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return self.current.endpoint

    def _pid(self) -> int:
        assert self.current.proc is not None
        return self.current.proc.pid

    def _server(self, port: int | None) -> ServerProcess:
        return ServerProcess(
            self._args,
            port=port,
            backend=self._backend,
            l1_size_gb=self._l1_size_gb,
            start_timeout_s=self._start_timeout_s,
        )

    def _start_again(self) -> None:
        self.current = self._server(self.current.port)
        self.current.start()
        self.pids.append(self._pid())

    def restart(self, how: str) -> None:
        """Restart the server ``how`` (one of :data:`HOW`); ``down`` returns at once."""
        if how == "terminated":
            code = self.current.terminate()
            assert code == 0, f"the server exited with {code}"
            self._start_again()
        elif how == "killed":
            self.current.kill()
            self._start_again()
        elif how == "down":
            self.current.kill()

            def later() -> None:
                threading.Event().wait(DOWN_S)
                self._start_again()

            self._starter = threading.Thread(target=later, name="lmc-test-restart", daemon=True)
            self._starter.start()
        else:
            raise ValueError(f"restart how={how!r}: one of {HOW}")

    def close(self) -> None:
        if self._starter is not None:
            self._starter.join()
            self._starter = None
        self.current.kill()
