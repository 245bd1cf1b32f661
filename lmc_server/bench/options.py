"""Every ``lmcache bench`` option declared once, as a field of its benchmark's config.

A config field made with :func:`opt` carries its default, help text, click type and
value parser; :func:`options` turns a config class into its command's click options
(the flag is ``--`` plus the field's name with ``-`` for ``_`` unless declared, a bool
is a ``--x/--no-x`` pair, a tuple default is shown comma-separated, a nested config such
as :class:`~lmc_server.bench.common.GeometryArgs` adds its own options in its place) and
:func:`build` makes the config from what click parsed. So a default is written once: a
config built in code and one built from the command line start from the same values,
and ``--help`` shows them. Options come in field order, which is the order of ``--help``;
fields without :func:`opt` (seeds, iteration caps) are not options. ``--json``,
``--plot`` and ``--no-progress`` say what to do with a report, not how to measure, so
they are plain click options here (:func:`output_options`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from lmc_server.bench import extras

F = TypeVar("F", bound=Callable[..., Any])
N = TypeVar("N", int, float)
C = TypeVar("C")
_KEY = "lmc_server.bench.option"

#: ``--backend``: the server's transfer engine.
BACKENDS = click.Choice(["cpu", "cuda"])


def _parse_positive(text: str, conv: Callable[[str], N], what: str) -> list[N]:
    try:
        out = [conv(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of {what}") from None
    if not out or min(out) <= 0:
        raise click.BadParameter(f"{text!r}: give positive {what}")
    return out


def ints(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[int, ...]:
    """Callback: a comma-separated list of positive integers."""
    return tuple(_parse_positive(value, int, "integers"))


def floats(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[float, ...]:
    """Callback: a comma-separated list of positive numbers."""
    return tuple(_parse_positive(value, float, "numbers"))


def words(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, ...]:
    """Callback: the non-empty items of a comma-separated list (``''``: none)."""
    return tuple(x for x in value.split(",") if x)


def names(allowed: tuple[str, ...], flag: str) -> Any:
    """Callback: a non-empty comma-separated list, each item (before any ``:``) one of
    ``allowed``."""

    def parse(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, ...]:
        out = tuple(x.strip() for x in value.split(",") if x.strip())
        bad = [x for x in out if x.partition(":")[0] not in allowed]
        if not out or bad:
            raise click.BadParameter(
                f"{value!r}: choose from {', '.join(allowed)}", param_hint=flag
            )
        return out

    return parse


@dataclass(frozen=True)
class Opt:
    """What the command line needs of one config field beyond its name and default."""

    help: str
    flag: str = ""  # empty: from the field's name (a bool: the --x/--no-x pair)
    type: Any = None  # a click type
    parse: Callable[..., Any] | None = None  # a click callback (never called with None)


def opt(
    default: Any,
    help: str,
    *,
    flag: str = "",
    type: Any = None,
    parse: Callable[..., Any] | None = None,
) -> Any:
    """A config field that is also a command-line option (``dataclasses.MISSING`` as
    the default: a required one). Typed ``Any`` so that the annotation gives the type."""
    return dataclasses.field(default=default, metadata={_KEY: Opt(help, flag, type, parse)})


def _option(f: dataclasses.Field[Any], o: Opt) -> Callable[[F], F]:
    flag = o.flag or "--" + f.name.replace("_", "-")
    kwargs: dict[str, Any] = {"help": o.help}
    if f.type in ("bool", "bool | None") and "/" not in flag:
        flag = f"{flag}/--no-{flag[2:]}"
    if f.default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        d = f.default
        kwargs["default"] = ",".join(map(str, d)) if o.parse and isinstance(d, tuple) else d
    if o.type is not None:
        kwargs["type"] = o.type
    if o.parse is not None:
        parse = o.parse
        kwargs["callback"] = lambda c, p, v: None if v is None else parse(c, p, v)
    return click.option(flag, f.name, **kwargs)


def options(cls: type) -> Callable[[F], F]:
    """The click options of every :func:`opt` field of ``cls``, in field order."""
    decorators: list[Callable[[F], F]] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default):
            decorators.append(options(type(f.default)))
        elif _KEY in f.metadata:
            decorators.append(_option(f, f.metadata[_KEY]))

    def apply(fn: F) -> F:
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return apply


def build(cls: type[C], parsed: dict[str, Any], **values: Any) -> C:
    """``cls`` from the options click parsed (nested configs too) and ``values``."""
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if dataclasses.is_dataclass(f.default):
            values.setdefault(f.name, build(type(f.default), parsed))
        elif _KEY in f.metadata and f.name in parsed:
            values.setdefault(f.name, parsed[f.name])
    return cls(**values)


def copy_modes_opt(help: str) -> Any:
    """``--cuda-copy-mode`` as a list of modes (``copy_modes``), one server each."""
    from lmc_server.config import CUDA_COPY_MODES

    return opt(
        ("auto", "staging", "dma"),
        help,
        flag="--cuda-copy-mode",
        parse=names(CUDA_COPY_MODES, "--cuda-copy-mode"),
    )


def _needs_matplotlib(ctx: click.Context, _param: click.Parameter, value: str | None) -> Any:
    if value and not ctx.resilient_parsing:
        extras.require("matplotlib")
    return value


def _needs_tqdm(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if not value and not ctx.resilient_parsing and sys.stderr.isatty():  # bars need a tty
        extras.require("tqdm")
    return value


def json_option(f: F) -> F:
    """``--json PATH`` (``json_path``): the full report."""
    return click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False),
        help="Write the full report as JSON here.",
    )(f)


def plot_option(help: str = "Write a PNG plot here.") -> Callable[[F], F]:
    """``--plot PATH`` (``plot_path``): the report drawn (needs matplotlib, the bench
    extra: a usage error naming it, before the benchmark starts)."""
    return click.option(
        "--plot",
        "plot_path",
        type=click.Path(dir_okay=False),
        callback=_needs_matplotlib,
        help=help + " Needs pip install 'lmc-server[bench]'.",
    )


def no_progress_option(f: F) -> F:
    """``--no-progress``; without it, on a terminal, tqdm must be installed (a usage
    error naming the bench extra, before the benchmark starts)."""
    return click.option(
        "--no-progress",
        is_flag=True,
        callback=_needs_tqdm,
        help="Hide the progress bar (drawn on a terminal; needs pip install 'lmc-server[bench]').",
    )(f)


def output_options(f: F) -> F:
    """``--json``, ``--plot`` and ``--no-progress``, in that order."""
    return json_option(plot_option()(no_progress_option(f)))
