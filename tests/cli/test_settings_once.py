"""Every setting is declared once; everything else is derived from that declaration.

The settings, enumerated from their groups: the server's (:class:`Config`, made of the
server's own group, the tiers' groups declared in ``lmc_server/tiers/`` and the KV-event
publisher's), the client commands' (:class:`ClientSettings`) and the vLLM connector's
(:class:`ConnectorSettings`). For each, the package's sources are walked (``ast``) for

* a second ``setting()`` of it (one per flag, variable and TOML key; a setting seen from
  another group is ``same_as()`` the first, which declares nothing);
* a field elsewhere that repeats it: a class attribute of its name (or the tail of its
  name, ``hwm`` for ``kv_events_hwm``) with its default written out, or a ``Protocol``
  member of its name (a restated list of what a layer reads);
* a hand-written click option with its flag, and a set of setting names written out
  (the keys a file accepts);

and what the commands, the TOML loader, the KV-event publisher and the connector docs
use is compared with the declarations. The detectors are run on planted duplicates too
(:data:`PLANTED`), so a detector that finds nothing fails.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest

import lmc_server
from lmc_server.cli.main import cli
from lmc_server.config import CLIENT_KEYS, CONFIG_KEYS, ClientSettings, Config
from lmc_server.declare import Declared, declarations
from lmc_server.integration.settings import PREFIX, ConnectorSettings
from lmc_server.server.events.settings import KvEventSettings, kv_event_settings

PACKAGE = Path(lmc_server.__file__).parent
ROOT = PACKAGE.parent
#: Not walked: the benchmarks' run configurations are their own (no command-line
#: settings of the server, the clients or the connector are declared there).
NOT_WALKED = {"bench"}

#: group -> (its declarations, the identity of one of its settings). The server's and
#: the client commands' settings share one namespace (flags, ``LMCACHE_*`` variables,
#: the TOML file): a setting there is its key; the connector's are ``lmcache.mp.KEY``.
GROUPS: dict[str, tuple[tuple[Declared, ...], str]] = {
    "server": (declarations(Config), "command line"),
    "client commands": (declarations(ClientSettings), "command line"),
    "connector": (declarations(ConnectorSettings), "connector"),
}


def identity(namespace: str, d: Declared) -> str:
    return PREFIX + d.name if namespace == "connector" else d.key


def every_setting() -> Iterator[tuple[str, str, Declared]]:
    for group, (decls, namespace) in GROUPS.items():
        for d in decls:
            yield group, namespace, d


COMMAND_LINE_NAMES = {d.name for _, ns, d in every_setting() if ns == "command line"}


@dataclass(frozen=True)
class Site:
    """One class attribute (or ``Protocol`` member) in a source file."""

    where: str  # path:line
    cls: str
    name: str
    call: str  # "setting", "same_as" or "" (not a declaration call)
    default: Any  # the literal default, or NO_LITERAL
    protocol: bool


NO_LITERAL = object()


def sites(source: str, where: str) -> list[Site]:
    out: list[Site] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        protocol = any(_name(b) == "Protocol" for b in node.bases)
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                call, default = "", NO_LITERAL
                if isinstance(item.value, ast.Call) and _name(item.value.func) in (
                    "setting",
                    "same_as",
                ):
                    call = _name(item.value.func)
                elif item.value is not None:
                    default = _literal(item.value)
                out.append(
                    Site(
                        f"{where}:{item.lineno}", node.name, item.target.id, call, default, protocol
                    )
                )
            elif protocol and isinstance(item, ast.FunctionDef):
                if any(_name(d) == "property" for d in item.decorator_list):
                    site = Site(
                        f"{where}:{item.lineno}", node.name, item.name, "", NO_LITERAL, True
                    )
                    out.append(site)
    return out


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    try:  # 1 << 20, 100 * 1000: constant arithmetic, folded here (never evaluated as code)
        return _fold(node)
    except (TypeError, ValueError, ArithmeticError):
        return NO_LITERAL


_BIN_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.LShift: operator.lshift,
    ast.Pow: operator.pow,
}


def _fold(node: ast.expr) -> Any:
    """A default written as arithmetic over number constants, folded; ValueError for
    anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        return _BIN_OPS[type(node.op)](_fold(node.left), _fold(node.right))
    raise ValueError("not constant arithmetic")


def package_sources() -> Iterator[tuple[str, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in NOT_WALKED:
            continue
        yield str(path.relative_to(ROOT)), path.read_text()


def package_sites() -> list[Site]:
    return [s for where, source in package_sources() for s in sites(source, where)]


SITES = package_sites()


# -- the detectors ------------------------------------------------------------------------


def declared_twice(all_sites: list[Site]) -> list[str]:
    """Settings with more than one ``setting()`` in the sources, or none."""
    calls: dict[str, list[str]] = {}
    for s in all_sites:
        if s.call == "setting":
            calls.setdefault(s.name, []).append(s.where)
    bad = []
    for group, namespace, d in every_setting():
        if d.same_as is not None:
            continue  # declared where it is the original's
        same = [
            e
            for g2, n2, e in every_setting()
            if n2 == namespace and e.same_as is None and identity(n2, e) == identity(namespace, d)
        ]
        if len(same) != 1:
            bad.append(f"{group} {identity(namespace, d)}: declared {len(same)} times")
        if not calls.get(d.name):
            bad.append(f"{group} {d.name}: no setting() found for it in the sources")
    declared = {d.name for _, _, d in every_setting() if d.same_as is None}
    for name, where in calls.items():
        groups = sum(1 for _, _, d in every_setting() if d.name == name and d.same_as is None)
        if name not in declared:
            bad.append(f"{name}: setting() at {where} is in no group this test enumerates")
        elif len(where) > groups:
            bad.append(f"{name}: setting() {len(where)} times ({', '.join(where)})")
    return bad


def restated(all_sites: list[Site]) -> list[str]:
    """Fields outside a declaration that repeat a setting: its name with its default
    written out (for a command-line setting also its name's tail after its group's
    prefix, ``hwm`` for ``kv_events_hwm``), or a ``Protocol`` standing for a settings
    object (two or more members named as one group's settings: a restated list of what
    a layer reads; one such member beside methods is an object's interface)."""
    bad = []
    members: dict[tuple[str, str, str], list[str]] = {}
    for s in all_sites:
        if s.call:
            continue
        for group, namespace, d in every_setting():
            if s.protocol and s.name == d.name:
                members.setdefault((s.where.split(":")[0], s.cls, group), []).append(s.name)
            tails = _tails(d.name) if namespace == "command line" else ()
            named = s.name == d.name or s.name in tails
            if named and s.default is not NO_LITERAL and _same(s.default, d.default):
                bad.append(
                    f"{s.where}: {s.cls}.{s.name} = {s.default!r} restates {group} "
                    f"{d.name}'s default"
                )
    for (path, cls, group), names in members.items():
        if len(names) >= 2:
            bad.append(f"{path}: Protocol {cls} restates {group} settings {names}")
    return bad


def _tails(name: str) -> tuple[str, ...]:
    """``kv_events_hwm`` -> ``hwm``, ``events_hwm``: the name less a leading part that
    other settings share (its group's prefix)."""
    parts = name.split("_")
    out = []
    for i in range(1, len(parts)):
        prefix = "_".join(parts[:i]) + "_"
        if any(p.startswith(prefix) and p != name for p in COMMAND_LINE_NAMES):
            out.append("_".join(parts[i:]))
    return tuple(out)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def hand_written_options(source: str, where: str) -> list[str]:
    """``click.option("--flag", ...)`` calls for a declared flag."""
    flags = {d.flag for group, ns, d in every_setting() if ns == "command line"}
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _name(node.func) == "option" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                flag = first.value.split("/")[0]
                if flag in flags:
                    bad.append(f"{where}:{node.lineno}: {flag} written by hand")
    return bad


def name_sets(source: str, where: str) -> list[str]:
    """Set literals of two or more setting names (a list of accepted keys written out)."""
    names = {d.name for _, _, d in every_setting()}
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Set) and len(node.elts) >= 2:
            values = [
                e.value
                for e in node.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
            if len(values) == len(node.elts) and set(values) <= names:
                bad.append(f"{where}:{node.lineno}: a set of setting names {sorted(values)}")
    return bad


# -- planted duplicates: each detector must find its own ---------------------------------

PLANTED = {
    "declared_twice": """
class ClientSettings:
    port: int = setting(5555, "Server port.", low=1, high=65535)
""",
    "restated_default": """
class KvEventSettings:
    endpoint: str
    hwm: int = 100_000
""",
    "restated_protocol": """
class L2Settings(Protocol):
    @property
    def l2_url(self) -> str: ...
    @property
    def l2_timeout_s(self) -> float: ...
""",
    "hand_written_option": """
f = click.option("--port", type=click.IntRange(1, 65535), default=5555)(f)
""",
    "name_set": """
CLIENT_KEYS = frozenset({"host", "port", "timeout_s"})
""",
}


def test_the_detectors_find_planted_duplicates() -> None:
    twice = sites(PLANTED["declared_twice"], "planted")
    assert declared_twice(SITES + twice), "a second setting() of --port went unseen"
    assert restated(sites(PLANTED["restated_default"], "planted")), "hwm = 100_000 unseen"
    assert restated(sites(PLANTED["restated_protocol"], "planted")), "Protocol l2_url unseen"
    assert hand_written_options(PLANTED["hand_written_option"], "planted")
    assert name_sets(PLANTED["name_set"], "planted")


# -- the package ----------------------------------------------------------------------------


def test_the_groups_hold_the_settings_of_every_part() -> None:
    """The enumeration reaches every part: the server's own, the tiers', the KV events',
    the client commands' and the connector's settings."""
    names = {g: {d.name for d in decls} for g, (decls, _) in GROUPS.items()}
    assert {"chunk_size", "l2_url", "l2_connections", "disk_dir", "disk_optional"} <= names[
        "server"
    ]
    assert {"kv_events_endpoint", "kv_events_hwm", "kv_events_replay_batches"} <= names["server"]
    assert names["client commands"] == {
        "host",
        "port",
        "timeout_s",
        "curve_server_key_file",
        "curve_client_secret_key_file",
    }
    assert {"port", "max_inflight", "l2_wait_s", "lookup_wait_s"} <= names["connector"]
    assert len(SITES) > 100, len(SITES)  # the walk saw the package's classes


def test_every_setting_is_declared_once() -> None:
    assert declared_twice(SITES) == []


def test_no_setting_is_restated_outside_its_declaration() -> None:
    assert restated(SITES) == []


def test_no_option_and_no_key_list_is_written_by_hand() -> None:
    bad = []
    for where, source in package_sources():
        bad += hand_written_options(source, where) + name_sets(source, where)
    assert bad == []


# -- what is derived agrees with the declarations ------------------------------------------


def _options(command: str) -> dict[str, click.Option]:
    params = cli.commands[command].params
    return {p.name: p for p in params if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize(
    "command,cls", [("server", Config), ("ping", ClientSettings), ("stats", ClientSettings)]
)
def test_each_commands_options_are_its_declarations(command: str, cls: type) -> None:
    options = _options(command)
    extra = {"config", "help", "as_json"}
    assert set(options) - extra == {d.name for d in declarations(cls)}
    for d in declarations(cls):
        opt = options[d.name]
        assert opt.default == d.default and d.flag in opt.opts, d.name
        assert opt.envvar == (d.envvar or None), d.name


def test_the_client_commands_take_the_servers_address_settings() -> None:
    server = {d.name: d for d in declarations(Config)}
    for d in declarations(ClientSettings):
        if d.same_as is None:
            continue
        assert d.same_as == server[d.name]
        assert (d.flag, d.envvar, d.default) == (
            server[d.name].flag,
            server[d.name].envvar,
            server[d.name].default,
        )
    assert {d.name for d in declarations(ClientSettings) if d.same_as} == {"host", "port"}


def test_the_file_keys_are_the_declarations() -> None:
    assert CONFIG_KEYS == {d.name for d in declarations(Config)}
    assert CLIENT_KEYS == {d.name for d in declarations(ClientSettings)}


def test_the_kv_event_publisher_reads_the_servers_settings() -> None:
    """Its settings are the server's, read by name: a value changed in the Config is the
    publisher's (no copy with a default of its own)."""
    config = Config(
        kv_events_endpoint="ipc:///tmp/x",
        kv_events_replay_endpoint="tcp://127.0.0.1:5999",
        kv_events_hwm=7,
        kv_events_replay_batches=9,
        heartbeat_timeout_s=1.5,
        kv_events_topic="t@",
    )
    s = kv_event_settings(config)
    assert (s.endpoint, s.replay_endpoint, s.hwm, s.replay_batches, s.heartbeat_timeout_s) == (
        "ipc:///tmp/x",
        "tcp://127.0.0.1:5999",
        7,
        9,
        1.5,
    )
    assert s.topic_prefix == "t@"
    assert [f for f in KvEventSettings.__dataclass_fields__] == ["config", "topic_prefix"]


#: docs/vllm.md's table rows: key, default cell.
CONNECTOR_ROW = re.compile(r"^\| `lmcache\.mp\.([a-z0-9_]+)` \| ([^|]*)\|", re.M)


def test_the_connector_docs_list_each_setting_with_its_default() -> None:
    rows = CONNECTOR_ROW.findall((ROOT / "docs" / "vllm.md").read_text())
    keys = [k for k, _ in rows]
    assert len(keys) == len(set(keys)), keys
    declared = {d.name: d for d in declarations(ConnectorSettings)}
    assert sorted(keys) == sorted(declared)
    for key, cell in rows:
        d, cell = declared[key], cell.strip()
        literal = re.fullmatch(r"`([^`]*)`", cell)
        if literal is None:  # words ("detected"): only for a setting unset by default
            assert not d.default, (key, cell)
        elif d.kind is bool:
            assert literal.group(1) == str(d.default).lower(), (key, cell)
        elif d.kind in (int, float):
            assert float(literal.group(1)) == d.default, (key, cell)
        else:
            assert literal.group(1) == d.default, (key, cell)
