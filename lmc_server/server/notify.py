"""systemd's readiness protocol (``sd_notify``) without libsystemd.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET``: a unix datagram socket (a path,
or an abstract name written with a leading ``@``). Each datagram is newline-separated
``KEY=value`` assignments; we send ``READY=1`` once the sockets are bound, ``STATUS=``
lines while the pool is prepared, ``STOPPING=1`` when shutdown begins, and
``WATCHDOG=1`` pings when the unit sets ``WatchdogSec`` (systemd then passes
``WATCHDOG_USEC``, and ``WATCHDOG_PID`` naming the process that must ping).

Without ``NOTIFY_SOCKET`` every call is a no-op, so the daemon behaves the same when run
by hand. A failed send is logged once and never raised: the notification channel must
not take the cache down.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def _address(raw: str) -> str | bytes | None:
    """The ``sendto`` address for ``NOTIFY_SOCKET``, or ``None`` if unusable."""
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # vsock (vsock:CID:PORT) and others are not supported


class Notifier:
    """Sends sd_notify datagrams to ``address``; ``None`` makes every call a no-op.

    ``watchdog_interval_s`` is how often :meth:`watchdog` should be called: half the
    ``WatchdogSec`` systemd asked for (its own recommendation), or ``None`` when the
    watchdog is off or addressed to another process.
    """

    def __init__(
        self, address: str | bytes | None, watchdog_interval_s: float | None = None
    ) -> None:
        self.address = address
        self.watchdog_interval_s = watchdog_interval_s if address is not None else None
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, pid: int | None = None) -> Notifier:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        address = _address(raw) if raw else None
        if raw and address is None:
            log.warning("NOTIFY_SOCKET %r is not a unix socket address; not notifying", raw)
        interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        wd_pid = env.get("WATCHDOG_PID", "")
        mine = str(os.getpid() if pid is None else pid)
        if usec.isdigit() and int(usec) > 0 and (not wd_pid or wd_pid == mine):
            interval_s = int(usec) / 1e6 / 2
        return cls(address, interval_s)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send one datagram of ``KEY=value`` lines; ``True`` if it was sent."""
        if self.address is None:
            return False
        payload = "\n".join(a.replace("\n", " ") for a in assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self.address)
        except OSError as e:
            if not self._warned:
                log.warning("cannot notify systemd at %r: %s", self.address, e)
                self._warned = True
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
