"""Each setting declared once: what ``lmcache server`` refuses on the
command line, :meth:`Config.check` refuses from code (the benchmarks and the in-process
server build a ``Config`` without click), with an error naming the flag; the defaults
agree; and a bad value from the environment or the TOML file is refused as a flag's is,
naming the variable or the file's key the user wrote.

The bounds are read from the command's click options, not from the declarations, so the
test holds the two paths to each other whatever produces them. Before the declarations,
``Config.check`` took 17 of these values that the command line refused (``--copy-threads
257``, ``--max-frame-bytes`` over 1 GiB, ``--l2-connections 0``, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from lmc_server.cli.main import cli
from lmc_server.config import Config, ConfigError, declarations

#: A pool that fits any test machine and holds a few slabs of the largest size.
BASE: dict[str, Any] = {"l1_size_gb": 1.0}


def _options() -> list[click.Option]:
    command = cli.commands["server"]
    return [
        p
        for p in command.params
        if isinstance(p, click.Option) and p.name not in (None, "help", "config")
    ]


def _flag(opt: click.Option) -> str:
    return next(o for o in opt.opts if o.startswith("--"))


def _outside(opt: click.Option) -> list[Any]:
    """Values just past each bound of a range option, or a choice not offered."""
    t = opt.type
    if isinstance(t, click.Choice):
        return ["no-such-choice"]
    if not isinstance(t, (click.IntRange, click.FloatRange)):
        return []
    step = 1 if isinstance(t, click.IntRange) else 0.5
    out = []
    if t.min is not None:
        out.append(t.min if t.min_open else t.min - step)
    if t.max is not None:
        out.append(t.max if t.max_open else t.max + step)
    return out


CASES = [(opt.name, _flag(opt), value) for opt in _options() for value in _outside(opt)]


def test_the_cases_cover_the_ranged_and_chosen_settings() -> None:
    names = {name for name, _, _ in CASES}
    assert {
        "port",
        "chunk_size",
        "max_frame_bytes",
        "l2_connections",
        "eviction_policy",
        "kv_events_hwm",
        "l1_size_gb",
        "drain_timeout_s",
    } <= names, names


@pytest.mark.parametrize("name,flag,value", CASES)
def test_what_the_command_line_refuses_the_config_check_refuses(
    name: str, flag: str, value: Any
) -> None:
    with pytest.raises(ConfigError) as e:
        Config(**{**BASE, name: value}).check()
    assert flag in str(e.value), str(e.value)


def test_every_default_passes_the_check() -> None:
    Config(**BASE).check()


@pytest.mark.parametrize("opt", _options(), ids=lambda o: o.name)
def test_the_command_lines_default_is_the_configs(opt: click.Option) -> None:
    default = opt.default
    assert default == getattr(Config(), opt.name or ""), opt.name


#: Refused by ``Config.check`` whatever else is given (no CURVE on a wildcard address),
#: so a bad value click let through would show as a wrong message, not a running server.
GUARD = ["--host", "0.0.0.0"]
ENVVARS = {d.name: d.envvar for d in declarations(Config)}
KEYS = {d.name: d.key for d in declarations(Config)}


def _refused(res: Any, where: str) -> None:
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {where}" in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("name,flag,value", CASES)
def test_a_bad_value_on_the_command_line_is_refused_naming_the_flag(
    name: str, flag: str, value: Any
) -> None:
    res = CliRunner().invoke(cli, ["server", *GUARD, flag, str(value)])
    _refused(res, f"'{flag}': ")


@pytest.mark.parametrize("name,flag,value", CASES)
def test_a_bad_value_from_the_environment_is_refused_naming_the_variable(
    name: str, flag: str, value: Any
) -> None:
    """The user set a variable, not the flag: the error names the variable first."""
    env = {ENVVARS[name]: str(value)}
    res = CliRunner().invoke(cli, ["server", *GUARD], env=env)
    _refused(res, f"{ENVVARS[name]} (the environment's {flag}): ")


@pytest.mark.parametrize("name,flag,value", CASES)
def test_a_bad_value_from_the_config_file_is_refused_naming_the_key(
    tmp_path: Path, name: str, flag: str, value: Any
) -> None:
    toml = tmp_path / "server.toml"
    toml.write_text(f"{KEYS[name]} = {json.dumps(value)}\n")
    res = CliRunner().invoke(cli, ["server", "--config", str(toml), *GUARD])
    _refused(res, f"{KEYS[name]} in the --config file ({flag}): ")


def test_the_guard_alone_is_refused_by_the_check() -> None:
    res = CliRunner().invoke(cli, ["server", *GUARD, "--l1-size-gb", "1"])
    assert res.exit_code == 2 and "refusing to listen" in res.output, res.output
