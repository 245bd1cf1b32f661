"""The zmq ROUTER socket, driven directly from the event loop.

Not through ``zmq.asyncio``: ``add_reader`` on the socket's file descriptor, and one
readiness callback (:meth:`Router.drain`) drains every queued message with
non-blocking ``recv``, so the control path costs one decode, one handler call and one
send per request, with no future per message. zmq's descriptor is edge-triggered:
after a send from outside a drain, :meth:`Router.after_io` looks whether messages
arrived meanwhile and schedules a drain, or they would wait for the next edge.

Connection events come from the socket's monitor (accepted and disconnected, by file
descriptor); :class:`~lmc_server.server.peers.ConnectionTracker` turns a closed
descriptor into the peer identities that talked over it, and ``on_disconnect`` gets
them (the server drops their sessions). Everything here runs on the loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from lmc_server.config import Config
from lmc_server.server.peers import Conn, ConnectionTracker
from lmc_server.server.security import bind_ipc, remove_ipc, start_curve

log = logging.getLogger(__name__)

#: Messages handled per readiness callback before yielding to other tasks.
DRAIN_BUDGET = 256
#: zmq drops (disconnects) peers whose frames exceed this multiple of max_frame_bytes.
HARD_FRAME_FACTOR = 4
#: zmq's flags and option as plain ints. pyzmq's are IntFlag members: ``x & zmq.POLLIN``
#: and ``zmq.NOBLOCK | zmq.SNDMORE`` run the enum module's Python operators and build a
#: new member each time, 0.6-0.7 us against 14 ns for plain ints (timeit, 2-core VM),
#: five or six times per request on the hot path.
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)


class Router:
    """One bound ROUTER socket: frames in to ``on_message``, replies out with :meth:`send`.

    ``on_message`` (given to :meth:`open`, which starts reading: the dispatcher that
    reads messages is built with this router, which sends its replies) gets
    ``[identity, *payload frames]`` as zmq frames; ``on_disconnect`` gets a closed
    connection and the identities seen on it. Invariant: every connection
    event queued before a message is handled before that message's peer is attributed
    to a connection (:meth:`attribute`), so a reused descriptor never carries a peer
    over to the wrong connection.
    """

    def __init__(
        self,
        config: Config,
        loop: asyncio.AbstractEventLoop,
        peers: ConnectionTracker,
        on_disconnect: Callable[[Conn, list[bytes]], None],
    ) -> None:
        self.config = config
        self.loop = loop
        self.peers = peers
        self._on_message: Callable[[list[zmq.Frame]], None] | None = None
        self._on_disconnect = on_disconnect
        #: set by :meth:`end_drain`: the drain stops after the message being handled
        self._end_drain = False
        self._auth: Any = None
        self._fd: int | None = None
        self._monitor_fd: int | None = None
        self._ipc_inode: int | None = None  # of the ipc socket file, once bound
        self.monitor: zmq.Socket[Any] | None = None
        self.ctx = zmq.Context()
        self.sock: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)

    def open(self, on_message: Callable[[list[zmq.Frame]], None]) -> None:
        """Set the socket's limits, bind it (CURVE, ipc) and start reading it into
        ``on_message``."""
        self._on_message = on_message
        cfg, sock = self.config, self.sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # dual-stack: --host ::1 and IPv6 names bind
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes * HARD_FRAME_FACTOR)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        hb_ms = int(cfg.heartbeat_timeout_s * 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, hb_ms // 4))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, hb_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, hb_ms)
        if cfg.curve_secret_key_file:
            self._auth = start_curve(
                self.ctx, sock, cfg.curve_secret_key_file, cfg.curve_clients_dir
            )
        try:
            sock.bind(cfg.endpoint)
        except zmq.ZMQError as e:
            fix = (
                "; choose another --port, or stop what holds it (another lmcache server?)"
                if e.errno == errno.EADDRINUSE
                else ""
            )
            raise OSError(f"cannot listen on {cfg.endpoint}: {e.strerror}{fix}") from None
        if cfg.ipc_path:
            self._ipc_inode = bind_ipc(sock, cfg.ipc_path, cfg.ipc_group)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor_fd = int(self.monitor.getsockopt(zmq.FD))
        self.loop.add_reader(self._monitor_fd, self.drain_monitor)
        self._fd = int(sock.getsockopt(zmq.FD))
        self.loop.add_reader(self._fd, self.drain)

    # -- the hot path -------------------------------------------------------------------

    def drain(self) -> None:
        """Handle every queued message (up to a budget, then yield and continue)."""
        sock = self.sock
        if not sock.closed:
            self.drain_monitor()
        on_message = self._on_message
        if on_message is None:  # not open: nothing is read
            return
        for _ in range(DRAIN_BUDGET):
            try:
                # Asked first rather than ending on zmq.Again: the exception costs
                # about 4 us more, two or three times per message on a busy socket.
                if sock.closed or not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                    return
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if sock.closed:
                    return
                log.warning("receive failed: %s", e)
                return
            on_message(frames)
            if self._end_drain:
                self._end_drain = False
                break
        self.loop.call_soon(self.drain)

    def end_drain(self) -> None:
        """Stop the drain under way after the message being handled, and go on with a
        new one at the next loop iteration, after the callbacks that message scheduled
        (a store answered inside the drain has its KV events numbered and sent first,
        as when each store was answered in an iteration of its own)."""
        self._end_drain = True

    def after_io(self) -> None:
        """A send outside a drain may have taken the edge of messages that arrived
        meanwhile: look now (a look deferred to the end of the iteration lets a request
        that arrives in between be read before the callbacks its reply's request
        scheduled, such as the KV events of a store being numbered)."""
        if not self.sock.closed and int(self.sock.getsockopt(_EVENTS)) & _POLLIN:
            self.loop.call_soon(self.drain)

    def send(self, identity: bytes, payload: bytes) -> None:
        if self.sock.closed:
            return
        try:
            sock = self.sock
            sock.send(identity, _NOBLOCK_SNDMORE)
            sock.send(payload, _NOBLOCK)
        except zmq.Again:
            log.warning(
                "reply dropped: peer %s is not reading (send queue full)", identity.hex()[:8]
            )
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                log.debug("reply to a peer that is gone dropped")
            else:
                log.warning("send failed: %s", e)

    # -- connections --------------------------------------------------------------------

    def drain_monitor(self) -> None:
        """Connection events: a connection that goes away (crash, kill -9, closed
        socket, or silent past the heartbeat timeout) is reported to ``on_disconnect``
        with every peer seen on it (see :mod:`lmc_server.server.peers`)."""
        monitor = self.monitor
        if monitor is None:
            return
        while True:
            try:
                if monitor.closed or not int(monitor.getsockopt(_EVENTS)) & _POLLIN:
                    return  # asked first: most drains find no connection event
                ev = recv_monitor_message(monitor, _NOBLOCK)
            except zmq.ZMQError:  # Again included: nothing queued
                return
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self.peers.accepted(fd)
                continue
            conn, identities = self.peers.closed(fd)
            self._on_disconnect(conn, identities)

    def attribute(self, identity: bytes, frame: zmq.Frame) -> Conn:
        """The connection a peer's first message (``frame``, its identity) came over."""
        self.drain_monitor()  # its accept may have been queued after this drain began
        return self.peers.attribute(identity, int(frame.get(zmq.SRCFD)))

    # -- closing ------------------------------------------------------------------------

    def close_socket(self) -> None:
        """Stop reading and close the socket and its monitor (nothing is sent after)."""
        sock = self.sock
        if sock.closed:
            return
        with contextlib.suppress(Exception):
            if self._fd is not None:
                self.loop.remove_reader(self._fd)
            if self._monitor_fd is not None:
                self.loop.remove_reader(self._monitor_fd)
        with contextlib.suppress(Exception):
            sock.disable_monitor()
            if self.monitor is not None:
                self.monitor.close(linger=0)
        sock.close(linger=0)

    def terminate(self) -> None:
        """Stop the CURVE authenticator, terminate the zmq context (last) and remove the
        ipc socket file."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.term()
        if self._ipc_inode is not None:
            remove_ipc(self.config.ipc_path, self._ipc_inode)
            self._ipc_inode = None
