"""Shared-memory descriptors handed to the server over a unix socket (SCM_RIGHTS).

The cpu engine maps a worker's KV segments. A worker that passes the segments' file
descriptors, instead of names under ``/dev/shm``, can register them any number of
times (another client, the same client after a server restart) and never leaves a
file behind: a descriptor dies with the last process holding it, however that process
ends (kill -9 included), and a nameless segment's memory goes with its last mapping.

The inbox listens on a socket in Linux's abstract namespace (``@lmc-fds-<pid>-<random>``:
no file to clean up either), named in the server's ``welcome``. A client connects,
sends one ``SOCK_SEQPACKET`` message of :data:`TOKEN_BYTES` random bytes carrying its
descriptors, and waits for ``ok``; its ``register`` then names ``(token, index)``
(:class:`~lmc_server.buffers.ShmFdBuffer`) and :meth:`FdInbox.take` hands the
descriptors to the mapping. Invariants:

* only a peer of the server's user or group (or root) is heard (``SO_PEERCRED``), as
  only those could share ``/dev/shm`` files with it (the deployment's ``UMask=0007``
  and shared group, docs/operations.md). A descriptor grants the server only memory
  its peer holds already; what the server then reads or writes there is decided on
  the main socket, under its own exposure rules;
* at most :data:`MAX_FDS_PER_MESSAGE` descriptors a message and :data:`MAX_PENDING_FDS`
  waiting in all; descriptors not taken within ``ttl_s`` are closed;
* a token is taken once (a second ``take`` of it fails), so a registration cannot map
  what another registration was handed.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time

from lmc_server.errors import LmcError
from lmc_server.threadnames import name_os_thread

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
MAX_FDS_PER_MESSAGE = 64
MAX_PENDING_FDS = 1024
#: How long descriptors wait for the registration that names them.
DEFAULT_TTL_S = 60.0
#: How long one peer may take to send its message after connecting.
PEER_TIMEOUT_S = 1.0
_UCRED = struct.Struct("3i")


class FdInboxError(LmcError):
    """A registration named descriptors the inbox does not hold."""


class FdInbox:
    """The server's end; a daemon thread accepts peers one at a time."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.name = f"lmc-fds-{os.getpid()}-{secrets.token_hex(8)}"
        self._uid, self._gid = os.geteuid(), os.getegid()
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[float, list[int]]] = {}
        self._n_pending = 0
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._serve, name="lmc-fd-inbox", daemon=True)
        self._thread.start()

    def take(self, token: bytes) -> list[int]:
        """The descriptors sent with ``token``; the caller closes them."""
        with self._lock:
            self._expire(time.monotonic())
            entry = self._pending.pop(token, None)
            if entry is None:
                raise FdInboxError(
                    "no descriptors under this token: hand them over on the server's "
                    "descriptor socket before registering (expired, taken, or sent to "
                    "another server process)"
                )
            self._n_pending -= len(entry[1])
            return entry[1]

    @property
    def pending_fds(self) -> int:
        with self._lock:
            return self._n_pending

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        with self._lock:
            for _, fds in self._pending.values():
                _close_all(fds)
            self._pending.clear()
            self._n_pending = 0

    # -- the inbox thread -------------------------------------------------------------

    def _serve(self) -> None:
        name_os_thread()
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                with self._lock:
                    self._expire(time.monotonic())
                continue
            except OSError as e:
                if not self._stop.is_set():
                    log.warning("descriptor socket: accept failed: %s", e)
                continue
            with conn:
                try:
                    conn.sendall(self._receive(conn))
                except OSError as e:
                    log.debug("descriptor socket: peer dropped: %s", e)

    def _receive(self, conn: socket.socket) -> bytes:
        """One peer's message: its answer, ``ok`` or ``error: ...``."""
        pid, uid, gid = _UCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        conn.settimeout(PEER_TIMEOUT_S)
        try:
            data, fds, flags, _ = socket.recv_fds(conn, TOKEN_BYTES + 1, MAX_FDS_PER_MESSAGE)
        except TimeoutError:
            return b"error: no message within the timeout"
        if uid not in (self._uid, 0) and gid != self._gid:
            _close_all(fds)
            log.warning(
                "descriptor socket: refused pid %d of uid %d, gid %d (not the server's)",
                pid,
                uid,
                gid,
            )
            return b"error: descriptors are taken from the server's own user or group only"
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or len(data) != TOKEN_BYTES or not fds:
            _close_all(fds)
            return (
                f"error: one message of {TOKEN_BYTES} bytes with 1 to "
                f"{MAX_FDS_PER_MESSAGE} descriptors expected"
            ).encode()
        with self._lock:
            self._expire(time.monotonic())
            if data in self._pending:
                _close_all(fds)
                return b"error: token in use"
            if self._n_pending + len(fds) > MAX_PENDING_FDS:
                _close_all(fds)
                return b"error: too many descriptors waiting for their registration"
            self._pending[data] = (time.monotonic() + self.ttl_s, fds)
            self._n_pending += len(fds)
        return b"ok"

    def _expire(self, now: float) -> None:
        """Close descriptors whose registration never came (lock held)."""
        for token in [t for t, (deadline, _) in self._pending.items() if deadline < now]:
            _, fds = self._pending.pop(token)
            self._n_pending -= len(fds)
            _close_all(fds)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
