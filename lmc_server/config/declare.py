"""One declaration per server setting, read by the command line, the checks and the docs.

A field of :class:`~lmc_server.config.settings.Config` is declared with :func:`setting`:
its default, help text, flag, range or choices. From that one declaration

* the CLI makes the click option (``lmc_server/cli/options.py``): flag, type with the
  range or choices, default, ``LMCACHE_*`` environment variable, help;
* :func:`check_declared` makes the simple checks of :meth:`Config.check`, so a ``Config``
  built in code (benchmarks, the in-process server) is refused exactly what the command
  line refuses;
* the TOML loader knows each key (the field's name and the flag's);
* ``tests/test_config_docs.py`` holds the docs' flag tables to it.

Invariants: a flag is ``--`` plus the field's name with ``-`` for ``_`` unless declared
otherwise (``--l2`` for ``l2_url``); the environment variable is always ``LMCACHE_``
plus the flag's name in capitals with ``_`` for ``-``; a bool is a ``--x/--no-x`` pair.
Checks that relate two settings or need the machine stay explicit code in ``Config``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmc_server.errors import LmcError

_KEY = "lmc_server.setting"
ENV_PREFIX = "LMCACHE_"


class ConfigError(LmcError, ValueError):
    """A setting is invalid; the message says which and what is allowed."""


@dataclass(frozen=True)
class Setting:
    """What the command line and the checks need to know of one field, beyond its type
    and default. ``help`` is a callable where the text depends on the machine (read when
    the CLI is built)."""

    help: str | Callable[[], str]
    flag: str = ""  # empty: from the field's name
    low: float | None = None  # least value (inclusive unless low_open)
    high: float | None = None  # greatest value, inclusive
    low_open: bool = False
    choices: tuple[str, ...] = ()
    any_case: bool = False  # choices compared without case
    metavar: str | None = None
    what: str = ""  # the setting in words for errors, where the flag is jargon

    def help_text(self) -> str:
        return self.help() if callable(self.help) else self.help


def setting(
    default: Any,
    help: str | Callable[[], str],
    *,
    flag: str = "",
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    choices: Sequence[str] = (),
    any_case: bool = False,
    metavar: str | None = None,
    what: str = "",
) -> Any:
    """A dataclass field with its :class:`Setting` (typed ``Any`` so that the field's
    annotation, not this function, gives its type)."""
    meta = Setting(help, flag, low, high, low_open, tuple(choices), any_case, metavar, what)
    return dataclasses.field(default=default, metadata={_KEY: meta})


@dataclass(frozen=True)
class Declared:
    """One declared field: its name, value type, default and :class:`Setting`."""

    name: str
    kind: type  # bool, int, float or str
    optional: bool  # None allowed (the default is then computed at startup)
    default: Any
    setting: Setting

    @property
    def flag(self) -> str:
        return self.setting.flag or "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """The flag's name without dashes and with ``_``: the TOML key it adds."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def envvar(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def label(self) -> str:
        return f"{self.setting.what} ({self.flag})" if self.setting.what else self.flag

    def range_text(self) -> str:
        """The range as click writes it (``1<=x<=65535``, ``x>0``)."""
        s = self.setting
        lo = "" if s.low is None else f"{_num(s.low)}{'<' if s.low_open else '<='}"
        hi = "" if s.high is None else f"<={_num(s.high)}"
        if s.high is None and s.low is not None:
            return f"x{'>' if s.low_open else '>='}{_num(s.low)}"
        return f"{lo}x{hi}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@functools.cache
def declarations(cls: type) -> tuple[Declared, ...]:
    """The declared fields of ``cls``, in field order (the order of ``--help``); every
    field must be declared (a ``TypeError`` otherwise, at import of the config)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
        kind, optional = _value_type(hints[f.name])
        out.append(Declared(f.name, kind, optional, f.default, meta))
    return tuple(out)


def _value_type(hint: Any) -> tuple[type, bool]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(args) == 1 and len(typing.get_args(hint)) == 2
    kind = args[0] if optional else hint
    if kind not in (bool, int, float, str):
        raise TypeError(f"a setting is bool, int, float or str (optionally None), not {hint}")
    return kind, optional


def check_declared(obj: object) -> None:
    """Raise :class:`ConfigError` for the first field of ``obj`` whose value is not of its
    type, not in its range or not one of its choices."""
    cls: type = type(obj)
    for d in declarations(cls):
        value = getattr(obj, d.name)
        if value is None and d.optional:
            continue
        if not _is_kind(value, d.kind):
            raise ConfigError(f"{d.label} {value!r}: not {_KIND_WORDS[d.kind]}")
        s = d.setting
        if s.choices:
            seen = value.upper() if s.any_case else value
            if seen not in s.choices:
                raise ConfigError(f"{d.label} {value!r}: choose one of {', '.join(s.choices)}")
        too_low = s.low is not None and (value <= s.low if s.low_open else value < s.low)
        if too_low or (s.high is not None and value > s.high):
            raise ConfigError(f"{d.label} {value} is not in the range {d.range_text()}")


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)
