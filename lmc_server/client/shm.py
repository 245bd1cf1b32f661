"""Shared-memory KV buffers for the server's cpu backend (CPU-only hosts, tests).

A worker whose KV cache lives in host memory allocates it here (:class:`ShmSegment`),
uses ``segment.array`` as that memory and registers ``segment.spec``: the server maps
the same pages, so stores and retrieves copy straight between them and its pool.

A segment is a nameless ``memfd`` sealed against resizing, so it exists only as long as
some process holds it: a worker or a server killed with SIGKILL at any moment leaves
nothing in ``/dev/shm`` (nothing of ours is ever there). The server maps a segment
from its file descriptor, which the client hands over on the server's descriptor
socket (SCM_RIGHTS, :mod:`lmc_server.transfer.fd_inbox`, named in the ``welcome``)
just before each registration (:func:`handed_over`). A segment therefore registers any
number of times: from several clients, and again after a server restart (the link
reconnects and hands it to the new server process).

Buffers that are not segments of this process (a name under ``/dev/shm`` that another
program manages) are sent as they are, and a server without a descriptor socket (the
null backend, which maps nothing) gets each segment's :attr:`ShmSegment.spec`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
import weakref
from collections.abc import Sequence

import numpy as np

from lmc_server.buffers import BufferSpec, ShmBuffer, ShmFdBuffer
from lmc_server.errors import LmcConnectionError, LmcTimeoutError

SHM_DIR = "/dev/shm"
#: This process's segments by name (weak: a segment dropped or closed leaves).
_LIVE: weakref.WeakValueDictionary[str, ShmSegment] = weakref.WeakValueDictionary()
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Bytes of a hand-over's token (as :data:`lmc_server.transfer.fd_inbox.TOKEN_BYTES`).
TOKEN_BYTES = 16


def hands_over(buffers: Sequence[BufferSpec]) -> bool:
    """Whether :func:`handed_over` has segments of this process to hand over."""
    return any(isinstance(b, ShmBuffer) and b.name in _LIVE for b in buffers)


def handed_over(
    buffers: Sequence[BufferSpec], fd_socket: str, timeout_s: float
) -> list[BufferSpec]:
    """``buffers`` for a registration message: the segments of this process among them
    handed to the server on ``fd_socket`` (one message, one token) and named by
    descriptor; any other buffer passed through. Blocks until the server took them.

    Raises ``ConnectionError`` if the server refused them or cannot be reached there,
    ``TimeoutError`` if it did not answer within ``timeout_s``."""
    segs = [_LIVE.get(b.name) if isinstance(b, ShmBuffer) else None for b in buffers]
    if not fd_socket or not any(segs):
        return list(buffers)
    fds: list[int] = []
    index: dict[int, int] = {}  # segment id -> its descriptor's index in the message
    for seg in segs:
        if seg is not None and id(seg) not in index:
            index[id(seg)] = len(fds)
            fds.append(seg.fileno())
    token = secrets.token_bytes(TOKEN_BYTES)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + fd_socket)
            socket.send_fds(sock, [token], fds)
            answer = sock.recv(256)
        except TimeoutError:
            raise LmcTimeoutError(
                f"the server's descriptor socket @{fd_socket} did not answer within {timeout_s} s"
            ) from None
        except OSError as e:
            raise LmcConnectionError(
                f"cannot hand shared-memory segments to the server on @{fd_socket}: {e} "
                "(the cpu backend needs the worker on the server's host, in its network "
                "namespace, under its user)"
            ) from None
    if answer != b"ok":
        text = answer.decode(errors="replace") or "connection closed"
        raise LmcConnectionError(f"the server refused the shared-memory segments: {text}")
    out: list[BufferSpec] = []
    for b, seg in zip(buffers, segs, strict=True):
        if seg is None:
            out.append(b)
        else:
            out.append(ShmFdBuffer(token=token, index=index[id(seg)], size_bytes=b.size_bytes))
    return out


class ShmSegment:
    """A zero-filled shared-memory segment of ``size_bytes`` this process created;
    ``array`` is a writable uint8 view of all of it (reshape or ``.view()`` it to the
    engine's layout), ``spec`` what a registration's ``buffers`` take. Close it (or use
    ``with``) once the registration is gone.

    ``name`` identifies the segment in this process (its :attr:`spec` names it; the
    client library hands the descriptor over instead, see the module docstring); no
    file has that name.
    """

    def __init__(self, size_bytes: int) -> None:
        self.name = f"lmc-{os.getpid()}-{secrets.token_hex(8)}"
        self.size_bytes = size_bytes
        self._fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, size_bytes)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
            self._mm = mmap.mmap(self._fd, size_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self._closed = False
        _LIVE[self.name] = self

    @property
    def spec(self) -> ShmBuffer:
        return ShmBuffer(name=self.name, size_bytes=self.size_bytes)

    @property
    def closed(self) -> bool:
        """Closed: its descriptor is gone (it cannot be registered), its addresses may
        be another mapping's."""
        return self._closed

    def fileno(self) -> int:
        if self._closed:
            raise ValueError(f"shared-memory segment {self.name} is closed")
        return self._fd

    def close(self) -> None:
        """Close the descriptor, and unmap unless views of ``array`` are still alive
        elsewhere (the mapping then goes away with the last view). The memory is freed
        once no process (the server included) maps it any more."""
        if self._closed:
            return
        self._closed = True
        _LIVE.pop(self.name, None)
        os.close(self._fd)
        if not self._mm.closed:
            self.array = np.empty(0, dtype=np.uint8)
            try:
                self._mm.close()
            except BufferError:
                pass

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
