"""The click options and value parsers that more than one ``lmcache bench`` command uses.

One definition each, so a flag spelled, checked and explained the same in two commands
is the same object; where two commands explain a flag differently (``--backend``,
``--cuda-copy-mode``, ``--plot``) the decorator takes the help text, so each command's
``--help`` stays what it says. Options are applied in the order they are listed in a
command, which is the order ``--help`` shows them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from lmc_server.bench import extras
from lmc_server.config import CUDA_COPY_MODES

F = TypeVar("F", bound=Callable[..., Any])
N = TypeVar("N", int, float)


def _parse_positive(text: str, conv: Callable[[str], N], what: str) -> list[N]:
    try:
        out = [conv(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of {what}") from None
    if not out or min(out) <= 0:
        raise click.BadParameter(f"{text!r}: give positive {what}")
    return out


def parse_ints(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (click callback helper)."""
    return _parse_positive(text, int, "integers")


def parse_floats(text: str) -> list[float]:
    """``"0.05,0.1"`` -> ``[0.05, 0.1]`` (click callback helper)."""
    return _parse_positive(text, float, "numbers")


def ints(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[int, ...]:
    """Callback: a comma-separated list of positive integers."""
    return tuple(parse_ints(value))


def floats(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[float, ...]:
    """Callback: a comma-separated list of positive numbers."""
    return tuple(parse_floats(value))


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


def geometry_options(f: F) -> F:
    """Click options that build a preset geometry (DSV4.1-Flash unless ``--model``)."""
    opts = [
        click.option(
            "--model",
            type=click.Choice(["dsv41", "llama-flash-attn", "llama-flashinfer"]),
            default="dsv41",
            help="KV preset: dsv41 (DeepSeek-V4.1-Flash), or a Llama-3-8B-like model "
            "(32 layers, 8 KV heads x 128, bf16, 16-token blocks, a KV tensor per layer) "
            "in the FlashAttention ([2, blocks, ...]: K and V planes) or FlashInfer "
            "([blocks, 2, ...]) shape.",
        ),
        click.option(
            "--arch",
            type=click.Choice(["sm90", "sm100"]),
            default="sm90",
            help="Record format of the preset (584 B/state on sm90, 528 on sm100).",
        ),
        click.option(
            "--layers",
            type=click.IntRange(1, 512),
            default=None,
            help="Layers of the preset (default: 44 for dsv41, illustrative, the model "
            "card has none; 32 for the Llama-like ones).",
        ),
        click.option(
            "--sliding-groups",
            type=click.IntRange(1, 16),
            default=2,
            help="Sliding-window engine groups the layers are split into.",
        ),
        click.option(
            "--kv-source-every",
            type=click.IntRange(1, 64),
            default=2,
            help="Every n-th layer has compressed KV and an indexer.",
        ),
        click.option(
            "--window-tokens",
            type=click.IntRange(1, 1 << 16),
            default=128,
            help="Sliding window in tokens.",
        ),
        click.option(
            "--stride-pad",
            type=click.IntRange(0, 1 << 20),
            default=0,
            help="Extra bytes between blocks (engines may pad strides).",
        ),
        click.option(
            "--placement",
            type=click.Choice(["block", "layer"]),
            default="block",
            help="Where the KV pages sit: block (every layer of a block side by "
            "side, as vLLM lays out DeepSeek-V4) or layer (a tensor per "
            "layer).",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def backend_option(help: str) -> Callable[[F], F]:
    """``--backend cpu|cuda`` (default cpu): the server's transfer engine."""
    return click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", help=help)


def copy_modes_option(help: str) -> Callable[[F], F]:
    """``--cuda-copy-mode`` as a list of modes (``copy_modes``), one server each."""
    return click.option(
        "--cuda-copy-mode",
        "copy_modes",
        default="auto,staging,dma",
        callback=names(CUDA_COPY_MODES, "--cuda-copy-mode"),
        help=help,
    )


def device_option(f: F) -> F:
    """``--device N``: the CUDA device the benchmark's KV lives on."""
    return click.option("--device", type=click.IntRange(0), default=0, help="cuda device.")(f)


def json_option(f: F) -> F:
    """``--json PATH`` (``json_path``): the full report."""
    return click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False),
        help="Write the full report as JSON here.",
    )(f)


def _needs_matplotlib(ctx: click.Context, _param: click.Parameter, value: str | None) -> Any:
    if value and not ctx.resilient_parsing:
        extras.require("matplotlib")
    return value


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


def _needs_tqdm(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if not value and not ctx.resilient_parsing and sys.stderr.isatty():  # bars need a tty
        extras.require("tqdm")
    return value


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
