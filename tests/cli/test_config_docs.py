"""The docs' flag tables held to the declarations of :class:`Config`.

Every ``lmcache server`` setting is listed in the "Settings" table of docs/operations.md
or of docs/l2.md (the L2 tier's), once, with the environment variable the server reads
and a default that agrees with the declared one. The environment file shipped for
systemd names no variable that nothing reads, and the defaults it shows are the
declared ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from lmc_server.cli.main import cli
from lmc_server.config import Config, Declared, declarations
from lmc_server.tiers.url import PASSWORD_ENV

ROOT = Path(__file__).resolve().parents[2]
DECLARED = {d.flag: d for d in declarations(Config)}
#: Documented in the settings table, but a flag of the command only (no Config field).
COMMAND_ONLY = {"--config"}
ROW = re.compile(r"^\| `(--[a-z0-9-]+)[^`]*` \| *(?:`([A-Z0-9_]+)`)? *\|([^|]*)\|", re.M)


def _section(doc: str, title: str) -> str:
    text = (ROOT / "docs" / doc).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _rows() -> list[tuple[str, str, str, str]]:
    """(doc, flag, environment variable, default cell) of each settings table row."""
    out = []
    for doc in ("operations.md", "l2.md"):
        rows = ROW.findall(_section(doc, "Settings"))
        assert rows, f"docs/{doc} has no settings table any more"
        out += [(doc, flag, env, default.strip()) for flag, env, default in rows]
    return out


ROWS = _rows()


def test_every_setting_is_documented_once_and_nothing_else_is() -> None:
    flags = [flag for _, flag, _, _ in ROWS]
    assert sorted(set(flags) - COMMAND_ONLY) == sorted(DECLARED), (
        "in the docs, not declared:",
        set(flags) - COMMAND_ONLY - set(DECLARED),
        "declared, not in the docs:",
        set(DECLARED) - set(flags),
    )
    assert len(flags) == len(set(flags)), [f for f in flags if flags.count(f) > 1]


DOCUMENTED = [r for r in ROWS if r[1] in DECLARED]


@pytest.mark.parametrize("doc,flag,env,cell", DOCUMENTED, ids=[r[1] for r in DOCUMENTED])
def test_the_documented_variable_and_default_are_the_declared_ones(
    doc: str, flag: str, env: str, cell: str
) -> None:
    d = DECLARED[flag]
    assert env == d.envvar, f"docs/{doc}: {flag} is read from {d.envvar}, not {env!r}"
    assert _agrees(d, cell), f"docs/{doc}: {flag}'s default is {d.default!r}, not {cell!r}"


def _agrees(d: Declared, cell: str) -> bool:
    """A literal (``\\`256\\```, ``4096``, ``on``) must be the default; words (``(none)``,
    ``a quarter of RAM``, ``stderr``) may only stand for an unset one (empty, 0, None)."""
    if d.kind is bool:
        return cell.split()[0] == ("on" if d.default else "off")
    literal = re.match(r"`([^`]*)`|(-?\d[\d.]*)\b", cell)
    if literal is None:
        return not d.default
    return _same(d, literal.group(1) if literal.group(1) is not None else literal.group(2))


def _same(d: Declared, text: str) -> bool:
    if d.kind in (int, float):
        try:
            return float(text) == float(d.default)
        except (TypeError, ValueError):
            return False
    return bool(text == d.default)


def _read_variables() -> set[str]:
    """Every LMCACHE_* variable some command reads, and the L2 password's."""
    out = {PASSWORD_ENV}
    for command in cli.commands.values():
        for p in command.params:
            envvar: Any = getattr(p, "envvar", None)
            if isinstance(envvar, str):
                out.add(envvar)
    return out


def test_the_docs_and_deploy_files_name_only_variables_that_are_read() -> None:
    read = _read_variables()
    files = [*(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").iterdir(), ROOT / "README.md"]
    for path in files:
        named = set(re.findall(r"LMCACHE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
        named -= {"LMCACHE_CURVE"}  # security.md's LMCACHE_CURVE_* (the client's two)
        assert named <= read, f"{path.relative_to(ROOT)}: nothing reads {named - read}"


def test_the_env_files_commented_values_are_the_defaults() -> None:
    """``#LMCACHE_X=value`` lines show the default ("uncomment to change"); a path or an
    endpoint there is an example, and so is a value of a setting that is unset by default
    (``--disk-size-gb``), so only the other numbers and true/false are held to it."""
    by_env = {d.envvar: d for d in declarations(Config)}
    text = (ROOT / "deploy" / "lmcache-server.env").read_text()
    shown = re.findall(r"^#(LMCACHE_[A-Z0-9_]+)=(\S+)$", text, re.M)
    checked = 0
    for env, value in shown:
        d = by_env.get(env)
        if d is None or (d.kind is not bool and not d.default):
            continue
        if d.kind is bool:
            assert value == str(d.default).lower(), (env, value)
        elif d.kind in (int, float) and re.fullmatch(r"-?\d[\d.]*", value):
            assert float(value) == d.default, (env, value, d.default)
        else:
            continue
        checked += 1
    assert checked >= 15, checked
