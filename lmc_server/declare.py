"""One declaration per setting, read by the command lines, the checks and the docs.

A setting is a field of a settings dataclass declared with :func:`setting`: its type
(the annotation), default, help text, flag, range or choices. The groups are the
server's :class:`~lmc_server.config.settings.Config` (made of the server's own group and
the tiers' groups, declared in ``lmc_server/tiers/``), the client commands'
:class:`~lmc_server.config.client.ClientSettings` and the vLLM connector's
:class:`~lmc_server.integration.settings.ConnectorSettings`. From that one declaration

* the CLI makes the click option (``lmc_server/cli/options.py``): flag, type with the
  range or choices, default, ``LMCACHE_*`` environment variable, help;
* :func:`check_declared` makes the simple checks of :meth:`Config.check`, so a ``Config``
  built in code (benchmarks, the in-process server) is refused exactly what the command
  line refuses; the connector refuses by the same ranges (:func:`outside`);
* the TOML loader knows each key (the field's name and the flag's);
* ``tests/cli/test_config_docs.py`` holds the docs' flag tables to it.

A setting that is another group's setting seen from elsewhere (the client commands'
``--port`` is the server's) is :func:`same_as` that declaration: everything but the help
text is the original's, so it cannot drift. ``tests/cli/test_settings_once.py`` finds every
setting declared once in the package.

This module is a leaf (it imports only the error root), so that every layer holding
settings, ``l2`` and ``integration`` below ``config`` included, declares them the same way.

Invariants: a flag is ``--`` plus the field's name with ``-`` for ``_`` unless declared
otherwise (``--l2`` for ``l2_url``); the environment variable is ``LMCACHE_`` plus the
flag's name in capitals with ``_`` for ``-`` (or none, where ``env=False``); a bool is a
``--x/--no-x`` pair. Checks that relate two settings or need the machine stay explicit
code in ``Config``.
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
_FROM = "lmc_server.setting.same_as"
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
    note: str = ""  # why the range is what it is, said with a refusal (the connector's)
    env: bool = True  # read from LMCACHE_<FLAG> too
    #: Settings one of which must be set for this one to do anything (a tier's): changed
    #: from its default without any of them, it is refused (``Config.check``).
    needs: tuple[str, ...] = ()

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
    note: str = "",
    env: bool = True,
    needs: Sequence[str] = (),
) -> Any:
    """A dataclass field with its :class:`Setting` (typed ``Any`` so that the field's
    annotation, not this function, gives its type)."""
    meta = Setting(
        help,
        flag,
        low,
        high,
        low_open,
        tuple(choices),
        any_case,
        metavar,
        what,
        note,
        env,
        tuple(needs),
    )
    return dataclasses.field(default=default, metadata={_KEY: meta})


def same_as(cls: type, name: str, help: str) -> Any:
    """A field that is the setting ``name`` of ``cls`` seen from another group: its
    default, flag, variable and range are that declaration's; only the help text, said
    for the new reader, is its own (the client commands' ``--port`` is the server's port:
    ``Server port.``). The original is :attr:`Declared.same_as`."""
    (d,) = (d for d in declarations(cls) if d.name == name)
    meta = dataclasses.replace(d.setting, help=help)
    return dataclasses.field(default=d.default, metadata={_KEY: meta, _FROM: d})


@dataclass(frozen=True)
class Declared:
    """One declared field: its name, value type, default and :class:`Setting`."""

    name: str
    kind: type  # bool, int, float or str
    optional: bool  # None allowed (the default is then computed at startup)
    default: Any
    setting: Setting
    same_as: Declared | None = None  # the declaration this one repeats (same_as())

    @property
    def flag(self) -> str:
        return self.setting.flag or "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """The flag's name without dashes and with ``_``: the TOML key it adds."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def envvar(self) -> str:
        """``LMCACHE_`` and the key in capitals; empty for a setting read from no variable."""
        return ENV_PREFIX + self.key.upper() if self.setting.env else ""

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


def declarations(cls: type) -> tuple[Declared, ...]:
    """The declared fields of ``cls``, in field order (the order of ``--help``); every
    field must be declared (a ``TypeError`` otherwise, at import of the config). Read
    once per class."""
    return _declarations(cls)


@functools.cache
def _declarations(cls: type) -> tuple[Declared, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
        kind, optional = _value_type(hints[f.name])
        out.append(Declared(f.name, kind, optional, f.default, meta, f.metadata.get(_FROM)))
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
        if outside(d, value):
            raise ConfigError(f"{d.label} {value} is not in the range {d.range_text()}")


def outside(d: Declared, value: float) -> bool:
    """Whether ``value`` is outside the declared range of ``d`` (NaN is outside every
    range: each bound is tested as "within", which NaN never is)."""
    s = d.setting
    if s.low is not None and not (value > s.low if s.low_open else value >= s.low):
        return True
    return s.high is not None and not value <= s.high


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)
