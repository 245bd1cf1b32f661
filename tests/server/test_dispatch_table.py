"""Every request type on the wire has exactly one handler, named by its tag."""

from __future__ import annotations

import typing

from lmc_server.protocol import messages as m
from lmc_server.server.dispatch import CONTROL_HANDLERS, DATA_REQUESTS, SYNC_REQUESTS, tag_of
from lmc_server.server.handlers import Handlers


def test_every_request_type_is_dispatched_once() -> None:
    handled = [*SYNC_REQUESTS, *DATA_REQUESTS, m.Stats]  # stats: the dispatcher's own
    assert len(handled) == len(set(handled))
    assert set(handled) == set(typing.get_args(m.Request))


def test_each_handler_is_the_method_named_by_the_tag() -> None:
    for cls in (*SYNC_REQUESTS, *DATA_REQUESTS):
        assert callable(getattr(Handlers, tag_of(cls), None)), tag_of(cls)
    assert tag_of(m.Lookup) == "lookup" and tag_of(m.Store) == "store"


def test_the_dispatch_table_names_each_control_request_s_handler_explicitly() -> None:
    """The table is written out (type -> method), not found by name at startup; this
    keeps it true to the naming rule above, and its keys are what the dispatcher
    answers at once."""
    assert tuple(CONTROL_HANDLERS) == SYNC_REQUESTS
    for cls, fn in CONTROL_HANDLERS.items():
        assert fn is getattr(Handlers, tag_of(cls)), (cls, fn)
