"""A fake systemd notification socket: what ``sd_notify`` would tell systemd.

:class:`FakeSystemd` binds the unix datagram socket systemd passes as
``NOTIFY_SOCKET`` (a path, or an abstract name) and collects every datagram on a
thread. Give its :attr:`~FakeSystemd.env_value` to a server process, or
:meth:`FakeSystemd.notifier` to an in-process server; then wait for assignments
(``READY=1``, ``WATCHDOG=1``, ``STATUS=...``) with bounded waits that return as soon as
they arrive.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmc_server.server.notify import Notifier


class FakeSystemd:
    """A bound unix datagram socket collecting sd_notify messages on a thread.

    ``messages`` holds ``(time.monotonic() at arrival, assignment lines)`` in order.
    """

    def __init__(self, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._dir = tempfile.mkdtemp(prefix="lmc-notify-")
        if abstract:
            name = f"lmc-notify-{os.getpid()}-{id(self)}"
            self.sock.bind(b"\0" + name.encode())
            self.env_value = "@" + name
        else:
            path = os.path.join(self._dir, "notify")
            self.sock.bind(path)
            self.env_value = path
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, list[str]]] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-systemd", daemon=True)
        self._thread.start()

    def __enter__(self) -> FakeSystemd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def notifier(self, watchdog_interval_s: float | None = None) -> Notifier:
        """A :class:`Notifier` that talks to this socket (for an in-process server)."""
        from lmc_server.server.notify import Notifier

        return Notifier(self.sock.getsockname(), watchdog_interval_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            with self._cond:
                self.messages.append((time.monotonic(), data.decode().split("\n")))
                self._cond.notify_all()

    def assignments(self) -> list[str]:
        with self._cond:
            return [a for _, lines in self.messages for a in lines]

    def count(self, assignment: str) -> int:
        """How many datagrams carried ``assignment`` so far."""
        with self._cond:
            return sum(assignment in lines for _, lines in self.messages)

    def wait_until(self, cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        """Return once ``cond()`` holds (checked at each datagram), or fail after
        ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(cond, timeout_s):
                raise AssertionError(
                    f"{what} not received in {timeout_s} s; got "
                    f"{[a for _, lines in self.messages for a in lines]}"
                )

    def wait_for(self, assignment: str, timeout_s: float = 10.0) -> float:
        """When the first datagram carrying ``assignment`` arrived (waits for one)."""

        def first() -> float | None:
            return next((t for t, lines in self.messages if assignment in lines), None)

        self.wait_until(lambda: first() is not None, assignment, timeout_s)
        with self._cond:
            t = first()
        assert t is not None
        return t

    def wait_count(self, assignment: str, n: int, timeout_s: float = 10.0) -> None:
        """Return once ``n`` datagrams carried ``assignment``."""
        self.wait_until(
            lambda: sum(assignment in lines for _, lines in self.messages) >= n,
            f"{n} x {assignment}",
            timeout_s,
        )

    def close(self) -> None:
        """Stop listening; what was sent before (``sendto`` returned) is in
        :attr:`messages` after this. Closing twice is harmless."""
        self._stop.set()
        self._thread.join()
        if self.sock.fileno() >= 0:
            self.sock.setblocking(False)
            with self._cond:
                while True:
                    try:
                        data = self.sock.recv(65536)
                    except BlockingIOError:
                        break
                    self.messages.append((time.monotonic(), data.decode().split("\n")))
            self.sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
