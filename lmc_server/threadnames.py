"""OS-level names for the server's threads, so per-thread CPU can be read by name.

Python (before 3.14) keeps ``threading.Thread.name`` to itself: every thread of the
server shows the process name in ``top -H``, ``ps -L`` and
``/proc/<pid>/task/<tid>/comm``, so nobody can tell the event loop from a copy thread.
:func:`name_os_thread` gives the calling thread a kernel name (``prctl(PR_SET_NAME)``
on Linux; a no-op elsewhere). Every thread the server starts calls it first: plain
threads at the top of their target, executors through ``initializer=name_os_thread``.

Invariants: the kernel keeps 15 bytes (and a NUL), so a longer name is cut to 15 bytes
on a character boundary; names in the package fit (``lmc-cuda0-wait``, ``lmc-copy_3``).
The main thread is never renamed: its name is the process name, which ``pgrep``,
``ps`` and ``systemctl status`` show; the server's event loop runs there, so "the
thread whose tid is the pid" is how a reader finds it. A failure to set a name never
fails the thread (a name is a diagnostic).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Bytes of a thread name the kernel keeps (``TASK_COMM_LEN`` less the NUL).
MAX_NAME_BYTES = 15
_PR_SET_NAME = 15


def os_name(name: str) -> bytes:
    """``name`` as the kernel will store it: UTF-8, at most 15 bytes, whole characters."""
    raw = name.encode()[:MAX_NAME_BYTES]
    return raw.decode(errors="ignore").encode()


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.debug("prctl not found: threads keep the process name")
        return None
    fn.restype = ctypes.c_int
    return fn


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread the OS name ``name`` (default: its ``threading`` name).

    No-op on the main thread and off Linux (see the module docstring).
    """
    if threading.current_thread() is threading.main_thread():
        return
    fn = _prctl()
    if fn is None:
        return
    wanted = os_name(name if name is not None else threading.current_thread().name)
    if fn(_PR_SET_NAME, ctypes.c_char_p(wanted), 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_NAME, %r) failed: errno %d", wanted, ctypes.get_errno())
