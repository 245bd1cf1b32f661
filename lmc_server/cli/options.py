"""The commands' options, made from the declarations of :class:`Config` (``lmcache
server``) and :class:`ClientSettings` (``lmcache ping``, ``lmcache stats``).

One click option per declared field, in field order: the flag (a ``--x/--no-x`` pair for
a bool), ``IntRange``/``FloatRange``/``Choice`` from the declared range or choices (so
a bad value from a flag, the environment or the TOML file is refused by click, naming
where the value came from: :class:`SourcedOption`), the default, the ``LMCACHE_*``
variable (``--help`` shows it), the help. The
option's parameter name is the field's, so ``Config(**kwargs)`` takes what click passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from lmc_server.config import Declared, declarations

F = TypeVar("F", bound=Callable[..., Any])


#: A click option callback: checks or converts the value (``lmcache ping --host``).
Callback = Callable[[click.Context, click.Parameter, Any], Any]


def declared_options(cls: type, callbacks: dict[str, Callback] | None = None) -> Callable[[F], F]:
    """A decorator adding the options of every declared field of ``cls``; ``callbacks``
    maps a field's name to its option's callback (a check beyond the declared range)."""
    decls = declarations(cls)
    callbacks = callbacks or {}
    unknown = set(callbacks) - {d.name for d in decls}
    if unknown:
        raise TypeError(f"callbacks for settings {cls.__name__} does not declare: {unknown}")

    def decorate(f: F) -> F:
        for d in reversed(decls):  # click lists the last-applied decorator first
            f = option(d, callbacks.get(d.name))(f)
        return f

    return decorate


class SourcedOption(click.Option):
    """A click option whose bad value is reported as the user gave it: a bad
    ``LMCACHE_CHUNK_SIZE=abc`` names the variable (and the flag it stands for), a bad
    value in the ``--config`` file names the file's key, a bad flag the flag. ``--help``
    shows the environment variable of each option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("show_envvar", True)
        super().__init__(*args, **kwargs)

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        try:
            return super().process_value(ctx, value)
        except click.BadParameter as e:
            source = ctx.get_parameter_source(self.name) if self.name else None
            flag = self.opts[0]
            if source is click.core.ParameterSource.ENVIRONMENT and self.envvar:
                e.param_hint = f"{self.envvar} (the environment's {flag})"
            elif source is click.core.ParameterSource.DEFAULT_MAP:
                key = flag.removeprefix("--").replace("-", "_")
                e.param_hint = f"{key} in the --config file ({flag})"
            else:
                e.param_hint = f"'{flag}'"
            raise


def option(d: Declared, callback: Callback | None = None) -> Callable[[F], F]:
    flag = f"{d.flag}/--no-{d.flag[2:]}" if d.kind is bool else d.flag
    return click.option(
        flag,
        d.name,
        cls=SourcedOption,
        type=click_type(d),
        default=d.default,
        envvar=d.envvar or None,
        metavar=d.setting.metavar,
        callback=callback,
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
