"""The KV-event replay buffer and its ROUTER socket (vLLM's replay protocol).

A subscriber that saw a gap in sequence numbers asks for every batch from a sequence
number on: ``[b"", start_seq]`` (8 bytes big-endian), answered with one ``[b"", topic,
seq, payload]`` per batch still kept, then ``[b"", b"", END_SEQ, b""]``. Kept: the last
``replay_batches`` batches, and at most :data:`REPLAY_MAX_BYTES` of payload (a batch of a
large store's tokens is hundreds of kilobytes). A replay is sent in slices of
:data:`REPLAY_SLICE` between other work on the event loop, never blocking, and cut when
the requester's queue is full (``replays_cut``). Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import zmq

from lmc_server.cache.counters import KvEventCounters
from lmc_server.protocol import kv_events as ev

log = logging.getLogger(__name__)

#: Replay messages sent per loop callback, so a replay never holds the loop for long.
REPLAY_SLICE = 256
#: Most bytes of payload kept for replay, whatever ``replay_batches`` allows.
REPLAY_MAX_BYTES = 64 << 20

_Batch = tuple[int, bytes, bytes]  # seq, topic, payload


class ReplayBuffer:
    """The last batches published, and the socket that serves them again."""

    def __init__(
        self, max_batches: int, loop: asyncio.AbstractEventLoop, stats: KvEventCounters
    ) -> None:
        self.loop = loop
        self.stats = stats
        self._buffer: deque[_Batch] = deque(maxlen=max_batches)
        self._bytes = 0
        self._sock: zmq.Socket[Any] | None = None
        self._fd = -1

    def __len__(self) -> int:
        return len(self._buffer)

    def keep(self, seq: int, topic: bytes, payload: bytes) -> None:
        buf = self._buffer
        if len(buf) == buf.maxlen:
            self._bytes -= len(buf[0][2])
        buf.append((seq, topic, payload))
        self._bytes += len(payload)
        while self._bytes > REPLAY_MAX_BYTES and len(buf) > 1:
            self._bytes -= len(buf.popleft()[2])

    def serve(self, sock: zmq.Socket[Any], endpoint: str) -> None:
        """Bind ``sock`` (a ROUTER) at ``endpoint`` and answer replay requests on it."""
        sock.setsockopt(zmq.SNDHWM, 2 * ((self._buffer.maxlen or 0) + 1))
        sock.bind(endpoint)
        self._sock = sock
        self._fd = int(sock.getsockopt(zmq.FD))
        self.loop.add_reader(self._fd, self._requests)

    def close(self) -> None:
        if self._sock is not None:
            self.loop.remove_reader(self._fd)
            self._sock.close(linger=0)
            self._sock = None

    def _requests(self) -> None:
        """Readiness of the socket: start a replay for every queued request."""
        sock = self._sock
        while sock is not None and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] or len(frames[2]) != ev.SEQ_BYTES:
                log.debug("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            start = int.from_bytes(frames[2], "big")
            self.stats.replays += 1
            batches = [b for b in self._buffer if b[0] >= start]  # a snapshot
            self._send_slice(frames[0], iter(batches))

    def _send_slice(self, ident: bytes, batches: Iterator[_Batch]) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            for _ in range(REPLAY_SLICE):
                item = next(batches, None)
                if item is None:
                    sock.send_multipart((ident, b"", b"", ev.END_SEQ, b""), zmq.NOBLOCK)
                    return
                seq, topic, payload = item
                sock.send_multipart((ident, b"", topic, ev.seq_frame(seq), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.stats.replays_cut += 1
            return
        self.loop.call_soon(self._send_slice, ident, batches)
        # zmq's descriptor is edge-triggered: requests that came in during the sends
        # raise no new edge.
        self.loop.call_soon(self._requests)
