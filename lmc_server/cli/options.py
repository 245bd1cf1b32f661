"""The ``lmcache server`` options, made from the declarations of :class:`Config`.

One click option per declared field, in field order: the flag (a ``--x/--no-x`` pair for
a bool), ``IntRange``/``FloatRange``/``Choice`` from the declared range or choices (so
a bad value from a flag, the environment or the TOML file is refused by click with its
usual message, naming the flag), the default, the ``LMCACHE_*`` variable, the help. The
option's parameter name is the field's, so ``Config(**kwargs)`` takes what click passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from lmc_server.config import Declared, declarations

F = TypeVar("F", bound=Callable[..., Any])


def declared_options(cls: type) -> Callable[[F], F]:
    """A decorator adding the options of every declared field of ``cls``."""
    decls = declarations(cls)

    def decorate(f: F) -> F:
        for d in reversed(decls):  # click lists the last-applied decorator first
            f = option(d)(f)
        return f

    return decorate


def option(d: Declared) -> Callable[[F], F]:
    flag = f"{d.flag}/--no-{d.flag[2:]}" if d.kind is bool else d.flag
    return click.option(
        flag,
        d.name,
        type=click_type(d),
        default=d.default,
        envvar=d.envvar,
        metavar=d.setting.metavar,
        help=d.setting.help_text(),
    )


def click_type(d: Declared) -> click.ParamType | None:
    s = d.setting
    if s.choices:
        return click.Choice(s.choices, case_sensitive=not s.any_case)
    if s.low is None and s.high is None:
        return None  # click's type from the default (a bool flag, text)
    if d.kind is int:
        return click.IntRange(_int(s.low), _int(s.high), min_open=s.low_open)
    return click.FloatRange(s.low, s.high, min_open=s.low_open)


def _int(x: float | None) -> int | None:
    return None if x is None else int(x)
