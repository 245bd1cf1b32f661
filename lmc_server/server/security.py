"""Exposure controls for the listening sockets: ipc:// permissions and zmq CURVE.

A client that can talk to the server can map the KV buffers it names and read what the
cache holds for its namespace, so the default is loopback tcp only (``Config.check``
refuses anything else without CURVE). ``ipc://`` sockets live in a folder only the
server's user (and, with ``--ipc-group``, the engine's group) can enter. CURVE encrypts
and authenticates: only clients whose public certificate is in ``--curve-clients-dir``
get in (checked by a ZAP authenticator thread).
"""

from __future__ import annotations

import grp
import logging
import os
import stat
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)


def bind_ipc(sock: zmq.Socket[Any], path: str, group: str = "") -> int:
    """Bind ``ipc://path`` with its folder 0700 (0770 and chgrp'd with ``group``);
    returns the socket file's inode, for :func:`remove_ipc` at shutdown."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    gid = grp.getgrnam(group).gr_gid if group else -1
    mode = 0o770 if group else 0o700
    if gid >= 0:
        os.chown(folder, -1, gid)
    os.chmod(folder, mode)
    sock.bind(f"ipc://{os.path.abspath(path)}")
    if gid >= 0:
        os.chown(path, -1, gid)
    os.chmod(path, 0o660 if group else 0o600)
    log.info(
        "listening on ipc://%s (folder mode %o%s)", path, mode, f", group {group}" if group else ""
    )
    return os.lstat(path).st_ino


def bound_ipc_file(endpoint: str) -> tuple[str, int] | None:
    """The socket file and inode of an ``ipc://`` endpoint just bound (for
    :func:`remove_ipc` at close); None for another transport or an abstract name."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    try:
        return path, os.lstat(path).st_ino
    except OSError:
        return None


def remove_ipc(path: str, inode: int) -> None:
    """Remove the socket file :func:`bind_ipc` made, once the socket is closed (zmq
    leaves it behind). Only that file: one another server bound at the same path since
    (a new inode) is left alone."""
    try:
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode:
            os.unlink(path)
    except OSError as e:
        log.warning("could not remove the ipc socket file %s: %s", path, e.strerror)


def start_curve(
    ctx: zmq.Context[Any], sock: zmq.Socket[Any], secret_file: str, clients_dir: str
) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that admits only the certificates in ``clients_dir``."""
    auth = start_authenticator(ctx, clients_dir)
    try:
        curve_server(sock, secret_file)
    except BaseException:
        auth.stop()
        raise
    log.info("CURVE on: clients admitted from %s", clients_dir)
    return auth


def start_authenticator(ctx: zmq.Context[Any], clients_dir: str) -> ThreadAuthenticator:
    """A ZAP authenticator for ``ctx``'s CURVE servers: the certificates in ``clients_dir``."""
    if not os.path.isdir(clients_dir):
        raise ValueError(f"CURVE clients folder {clients_dir} does not exist")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=clients_dir)
    return auth


def curve_server(sock: zmq.Socket[Any], secret_file: str) -> None:
    """Make ``sock`` (not bound yet) a CURVE server with the key pair in ``secret_file``."""
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise ValueError(f"{secret_file} holds no secret key (use NAME.key_secret)")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
