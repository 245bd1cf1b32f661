"""Poll until a condition holds: the one wait-loop of the benchmarks, the test helpers
and the tests.

:func:`wait_for` calls ``cond`` every ``poll_s`` until it returns something true and
returns that value, or raises ``error`` naming ``what`` once ``timeout_s`` has passed
(``AssertionError`` for tests, ``TimeoutError`` where a benchmark or a helper reports a
server that never got there). The condition is checked once more after the deadline's
last sleep, so a slow condition is never cut short by its own duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    cond: Callable[[], Any],
    what: str,
    timeout_s: float = 20.0,
    poll_s: float = 0.05,
    error: type[Exception] = AssertionError,
) -> Any:
    """``cond()``'s first true value, polled every ``poll_s`` for up to ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() - t0 > timeout_s:
            raise error(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
