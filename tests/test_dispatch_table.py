"""Every request type on the wire has exactly one handler, named by its tag."""

from __future__ import annotations

import typing

from lmc_server.protocol import messages as m
from lmc_server.server.dispatch import DATA_REQUESTS, SYNC_REQUESTS, tag_of
from lmc_server.server.handlers import Handlers


def test_every_request_type_is_dispatched_once() -> None:
    handled = [*SYNC_REQUESTS, *DATA_REQUESTS, m.Stats]  # stats: the dispatcher's own
    assert len(handled) == len(set(handled))
    assert set(handled) == set(typing.get_args(m.Request))


def test_each_handler_is_the_method_named_by_the_tag() -> None:
    for cls in (*SYNC_REQUESTS, *DATA_REQUESTS):
        assert callable(getattr(Handlers, tag_of(cls), None)), tag_of(cls)
    assert tag_of(m.Lookup) == "lookup" and tag_of(m.Store) == "store"
