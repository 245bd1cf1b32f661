"""The root of every error class of the package: ``except LmcError`` catches them all.

As redis-py's ``RedisError``: each error class here and in the layers descends from
:class:`LmcError` and keeps the builtin base a caller may already catch (``ValueError``
for a bad setting or geometry, ``RuntimeError`` for a copy that cannot be done,
``TimeoutError`` and ``ConnectionError`` for the client's waits), so both ``except
LmcError`` and the builtin handler work. Standard library only: every layer imports it.
"""

from __future__ import annotations


class LmcError(Exception):
    """Any error the package's own classes describe."""


class LmcTimeoutError(LmcError, TimeoutError):
    """A reply or a hand-over did not come in time (the client)."""


class LmcConnectionError(LmcError, ConnectionError):
    """The server is not there, or refused the connection's hand-over (the client)."""
