"""Imports point down the layers (docs/architecture.md, "Layers").

Scans the parsed source of every module under ``lmc_server/`` (every ``import`` and
``from ... import`` anywhere in the file: module level, inside functions, under
``TYPE_CHECKING``), maps each module to its layer (a subpackage, or a top-level module
such as ``config``), and fails on any edge between two layers that :data:`ALLOWED` does
not list. The table is the decision; the docs describe it. A known upward edge that
cannot be fixed yet is listed, per file and target, in :data:`KNOWN_EXCEPTIONS` with
the reason, so a new upward edge fails even in a file that already has one.

Also checked: the third-party imports that define a layer's promise (the cache core is
numpy and msgspec only, the protocol is sans-IO, CuPy only in the transfer engines),
that ``lmcache server`` loads neither the benchmarks nor the test helpers nor the client,
and that the cache core has one door: its partitions and the modules that change slot
states are imported inside ``lmc_server/cache/`` only (:data:`CACHE_PRIVATE`), and that
no import circle closes inside a layer (between modules of one layer, subpackages
included; the table above already keeps circles from crossing layers).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import lmc_server

PACKAGE = Path(lmc_server.__file__).parent

#: layer -> the layers it may import. Every layer may also import the root package
#: (``lmc_server/__init__.py``: ``__version__`` and ``PROTOCOL_VERSION``, no imports).
#: The table must stay acyclic (checked below).
ALLOWED: dict[str, set[str]] = {
    # Leaves. net: endpoint strings and address checks (stdlib only). logs: logging
    # setup for the daemon. buffers: the msgspec types that describe a worker's KV
    # buffers on the wire (shared memory, CUDA IPC); read by protocol, client, transfer.
    # threadnames: OS names for the threads the server starts (stdlib only). errors: the
    # root of every error class of the package (stdlib only; every layer may raise one).
    # declare: how a setting is declared (``setting()``), read by every layer that holds
    # settings, the tiers and the connector below ``config`` included.
    "errors": set(),
    "declare": {"errors"},
    "net": set(),
    "logs": set(),
    "buffers": set(),
    "threadnames": set(),
    # The cache core: geometry, layout, keys, pool, eviction, index. Imports nothing of
    # the package but the error root (and only numpy/msgspec outside it, see THIRD_PARTY).
    "cache": {"errors"},
    # Sans-IO wire protocol: messages carry group specs (cache) and buffer specs.
    "protocol": {"cache", "buffers", "errors"},
    # Transfer engines copy by the cache's layout into the buffers a worker registered.
    "transfer": {"cache", "buffers", "threadnames", "errors"},
    # The tiers below L1 (disk, L2) beside transfer: read and fill L1 slots through the
    # index, the pool and the engine's host pool. Declare their own settings (Config is
    # made of them).
    "tiers": {"cache", "transfer", "threadnames", "declare", "errors"},
    # Prometheus collector and HTTP endpoint. Reads the index (and the pool through it); the
    # server's own counters and sessions through protocols it defines (no server import).
    "metrics": {"cache", "net", "threadnames", "errors"},
    # Server settings: values and checks; the checks of a subsystem live with it (tiers).
    "config": {"cache", "protocol", "net", "tiers", "declare", "errors"},
    # The daemon: everything of the server stack below it.
    "server": {
        "protocol",
        "cache",
        "buffers",
        "transfer",
        "tiers",
        "metrics",
        "config",
        "logs",
        "net",
        "threadnames",
        "errors",
    },
    # Client library: speaks the protocol; digests and buffers for workers.
    "client": {"protocol", "cache", "buffers", "net", "errors"},
    # Engine integrations (vLLM) on top of the client.
    "integration": {"client", "protocol", "cache", "buffers", "net", "declare", "errors"},
    # Test helpers: presets, shared-memory KV caches, server and redis processes, and
    # the server in process (a thread, a fake clock): above the server, below bench.
    "testing": {
        "server",
        "config",
        "transfer",
        "integration",
        "client",
        "protocol",
        "cache",
        "buffers",
        "net",
        "threadnames",
        "errors",
    },
    # Benchmarks: measure a real server (process or in-process thread) with the client
    # and the test helpers; may use any layer below the CLI.
    "bench": {
        "testing",
        "integration",
        "client",
        "server",
        "config",
        "metrics",
        "tiers",
        "transfer",
        "protocol",
        "cache",
        "buffers",
        "net",
        "logs",
        "threadnames",
        "errors",
    },
    # The command line: builds a Config and runs the Server; admin commands use the
    # client; ``lmcache bench`` is loaded lazily (checked by a test below).
    "cli": {"bench", "server", "client", "config", "cache", "protocol", "net", "logs", "errors"},
    "__main__": {"cli", "errors"},
}

#: (importing module, imported layer) -> why the upward edge is still there. Each entry
#: names what must happen to remove it; the test fails if an entry is no longer needed.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}

#: Modules of the cache core that hold the slab pool and the partitions or change slot
#: states. Only the core imports them; the server, the tiers below L1, the metrics and
#: the tests go through ``L1Index`` (``cache/index.py``, which builds the slab pool and
#: re-exports the types it hands out), so every slab and slot transition keeps the
#: core's invariants and eviction order.
CACHE_PRIVATE = {"slab_pool", "pool", "allocator", "reservation", "store", "retrieve", "leases"}
#: Unit tests of those modules on their own (the core's rules below the index).
CACHE_WHITE_BOX_TESTS = {
    "test_allocator.py",
    "test_retention.py",
    "test_policies.py",
    "test_kv_events.py",
    "test_pin_runs.py",
}
TESTS = PACKAGE.parent / "tests"

#: layer -> third-party or stdlib top-level modules it must not import.
THIRD_PARTY_FORBIDDEN: dict[str, set[str]] = {
    "cache": {
        "zmq",
        "asyncio",
        "uvloop",
        "socket",
        "threading",
        "torch",
        "cupy",
        "prometheus_client",
        "redis",
    },
    "protocol": {"zmq", "asyncio", "uvloop", "socket", "threading", "torch", "cupy"},
    "buffers": {"zmq", "asyncio", "socket", "torch", "cupy", "numpy"},
    "threadnames": {"zmq", "asyncio", "socket", "torch", "cupy", "numpy"},
    **{
        layer: {"cupy"}
        for layer in (
            "server",
            "client",
            "integration",
            "testing",
            "bench",
            "tiers",
            "metrics",
            "cli",
            "config",
        )
    },
}
for _layer in ("server", "transfer", "tiers", "metrics", "config", "cli"):
    THIRD_PARTY_FORBIDDEN.setdefault(_layer, set()).add("torch")


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """``lmc_server.server.handlers`` -> ``server``; ``lmc_server.config`` -> ``config``;
    the root package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """Every (line, absolute module name) a file imports, anywhere in it. For
    ``from pkg import name`` both ``pkg`` and ``pkg.name`` are candidates; the caller
    keeps ``pkg.name`` when it is a module of the package (a submodule import).

    Parsed once per file version (path, size, mtime): six tests scan the whole package,
    and parsing it is most of their time."""
    st = path.stat()
    return list(_imports(path, root, st.st_size, st.st_mtime_ns))


@functools.cache
def _imports(path: Path, root: Path, _size: int, _mtime_ns: int) -> tuple[tuple[int, str], ...]:
    mod = module_name(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if _is_module(sub) else target))
    return tuple(sorted(set(out)))


def _is_module(name: str) -> bool:
    if not name.startswith("lmc_server."):
        return False
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def package_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50, files
    return files


def layer_edges(
    files: list[Path] | None = None, root: Path = PACKAGE
) -> dict[tuple[str, str], list[str]]:
    """(importing module, imported layer) -> ["module:line -> target", ...] for every
    import that crosses from one layer to another (the root package excluded)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in package_files() if files is None else files:
        mod = module_name(path, root)
        src = layer_of(mod)
        for line, target in imports(path, root):
            if target != "lmc_server" and not target.startswith("lmc_server."):
                continue
            dst = layer_of(target)
            if dst and dst != src:
                edges.setdefault((mod, dst), []).append(f"{mod}:{line} -> {target}")
    return edges


def upward_edges(files: list[Path] | None = None, root: Path = PACKAGE) -> list[str]:
    bad = []
    for (mod, dst), where in sorted(layer_edges(files, root).items()):
        src = layer_of(mod)
        assert src in ALLOWED, f"{mod}: layer {src!r} is not in ALLOWED; place it there"
        if dst not in ALLOWED[src] and (mod, dst) not in KNOWN_EXCEPTIONS:
            bad += where
    return bad


def test_every_layer_is_placed() -> None:
    layers = {layer_of(module_name(p)) for p in package_files()} - {""}
    assert layers == set(ALLOWED), layers ^ set(ALLOWED)


def test_the_allowed_table_is_acyclic() -> None:
    """Kahn's algorithm: a cycle in the table would make "down" meaningless."""
    deps = {k: set(v) for k, v in ALLOWED.items()}
    for k, v in deps.items():
        assert v <= set(ALLOWED), (k, v - set(ALLOWED))
    order = []
    while deps:
        leaves = sorted(k for k, v in deps.items() if not v)
        assert leaves, f"cycle among {sorted(deps)}"
        order += leaves
        deps = {k: v - set(leaves) for k, v in deps.items() if k not in leaves}
    assert order[-1] == "__main__"


def test_no_upward_edge_between_layers() -> None:
    bad = upward_edges()
    assert not bad, "imports that point up the layers (docs/architecture.md):\n" + "\n".join(bad)


def test_every_known_exception_is_still_needed() -> None:
    edges = layer_edges()
    stale = [k for k in KNOWN_EXCEPTIONS if k not in edges]
    assert not stale, f"remove from KNOWN_EXCEPTIONS (the edge is gone): {stale}"
    allowed_anyway = [k for k in KNOWN_EXCEPTIONS if k[1] in ALLOWED[layer_of(k[0])]]
    assert not allowed_anyway, allowed_anyway


def test_third_party_imports_keep_each_layer_promise() -> None:
    bad = []
    for path in package_files():
        mod = module_name(path)
        forbidden = THIRD_PARTY_FORBIDDEN.get(layer_of(mod), set())
        for line, target in imports(path):
            if target.split(".")[0] in forbidden:
                bad.append(f"{mod}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def _cache_private(target: str) -> bool:
    parts = target.split(".")
    return parts[:2] == ["lmc_server", "cache"] and len(parts) > 2 and parts[2] in CACHE_PRIVATE


def test_the_cache_core_has_one_door() -> None:
    """Nothing outside ``lmc_server/cache/`` imports the partitions or what changes
    slot states: not the package's other layers, not the tests (but the core's own
    unit tests), not the scripts."""
    bad = []
    for path in package_files():
        if layer_of(module_name(path)) == "cache":
            continue
        bad += [
            f"{module_name(path)}:{line} -> {target}"
            for line, target in imports(path)
            if _cache_private(target)
        ]
    outside = [p for p in sorted(TESTS.rglob("*.py")) if p.name not in CACHE_WHITE_BOX_TESTS]
    outside += sorted((PACKAGE.parent / "scripts").glob("*.py"))
    assert len(outside) > 40, outside
    for path in outside:
        bad += [
            f"{path.relative_to(PACKAGE.parent)}:{line} -> {target}"
            for line, target in imports(path)
            if _cache_private(target)
        ]
    assert not bad, "cache internals imported outside the core (use L1Index):\n" + "\n".join(bad)


def module_graph(
    files: list[Path] | None = None, root: Path = PACKAGE
) -> dict[str, dict[str, str]]:
    """module -> {imported module of the same layer: "module:line"} over the package.
    A ``from pkg import name`` counts as an import of ``pkg`` (its ``__init__``) unless
    ``name`` is a submodule; the root package and other layers are left out."""
    graph: dict[str, dict[str, str]] = {}
    for path in package_files() if files is None else files:
        mod = module_name(path, root)
        out = graph.setdefault(mod, {})
        for line, target in imports(path, root):
            if (
                target.startswith("lmc_server.")
                and target != mod
                and layer_of(target) == layer_of(mod)
            ):
                out.setdefault(target, f"{mod}:{line}")
    return graph


def import_circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each as its sorted module names: every import circle is inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def test_no_import_circle_inside_a_layer() -> None:
    """A circle (``a`` imports ``b`` imports ``a``, at module level or not, under
    ``TYPE_CHECKING`` too) means neither module can be read or moved without the other:
    the shared part belongs in a module both import."""
    graph = module_graph()
    found = []
    for circle in import_circles(graph):
        found.append(
            " <-> ".join(circle)
            + ": "
            + ", ".join(f"{graph[a][b]} -> {b}" for a in circle for b in circle if b in graph[a])
        )
    assert not found, "import circles inside a layer:\n" + "\n".join(found)


def test_the_circle_finder_finds_a_circle(tmp_path: Path) -> None:
    """Three modules in a ring (one import under TYPE_CHECKING, one relative) and a
    fourth that only imports into the ring: one circle of three."""
    root = tmp_path / "lmc_server"
    (root / "bench").mkdir(parents=True)
    (root / "bench" / "a.py").write_text("import lmc_server.bench.b\n")
    (root / "bench" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n"
    )
    (root / "bench" / "c.py").write_text("def f():\n    import lmc_server.bench.a\n")
    (root / "bench" / "d.py").write_text("from lmc_server.bench.a import f\n")
    files = sorted(root.rglob("*.py"))
    graph = module_graph(files, root)
    assert import_circles(graph) == [
        ["lmc_server.bench.a", "lmc_server.bench.b", "lmc_server.bench.c"]
    ], graph


def test_the_scanner_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Function-level, TYPE_CHECKING, relative and ``from pkg import submodule`` imports
    are all edges."""
    root = tmp_path / "lmc_server"
    (root / "cache").mkdir(parents=True)
    probe = root / "cache" / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..server import stats\n"
        "if TYPE_CHECKING:\n"
        "    from lmc_server.client.core import Registration\n"
        "def f():\n"
        "    import lmc_server.metrics.collector\n"
        "    from lmc_server import bench\n"
    )
    bad = upward_edges([probe], root)
    targets = sorted(b.split(" -> ")[1] for b in bad)
    assert targets == [
        "lmc_server.bench",
        "lmc_server.client.core",
        "lmc_server.metrics.collector",
        "lmc_server.server.stats",
    ], bad


def _loaded_after(imports: str, prefixes: tuple[str, ...]) -> list[str]:
    """Modules under ``prefixes`` loaded by a fresh interpreter after ``imports``."""
    code = (
        f"import sys\nimport {imports}\n"
        f"print(' '.join(sorted(m for m in sys.modules "
        f"if m.startswith({prefixes!r}) or m in {prefixes!r})))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return res.stdout.split()


def test_lmcache_server_loads_no_bench_testing_or_client() -> None:
    """What ``lmcache server`` imports before it runs: the CLI module and the server."""
    assert (
        _loaded_after(
            "lmc_server.cli.main, lmc_server.server.server",
            (
                "lmc_server.bench",
                "lmc_server.testing",
                "lmc_server.client",
                "lmc_server.integration",
            ),
        )
        == []
    )


def test_a_cpu_server_without_metrics_or_events_loads_no_prometheus_torch_or_cupy() -> None:
    """Each test starts a hundred-odd servers: the CPU engine's start-up imports only
    what it runs. Prometheus (and http.server) load with ``--metrics-port``, the KV-event
    publisher with ``--kv-events-endpoint``, CuPy and torch never on the CPU backend
    (they are absent in CI, so this holds where they are installed, the GPU machine)."""
    assert (
        _loaded_after(
            "lmc_server.cli.main, lmc_server.server.server, lmc_server.transfer.select, "
            "lmc_server.transfer.cpu, lmc_server.logs",
            ("prometheus_client", "http.server", "cupy", "torch", "lmc_server.server.events"),
        )
        == []
    )


def test_the_cli_loads_no_numpy_before_a_command_runs() -> None:
    """Every ``lmcache`` call (the tests make dozens that only check a usage error) pays
    for what the CLI module imports; numpy was two thirds of it. A command that needs
    it (the server, the client commands) imports it when it runs."""
    assert _loaded_after("lmc_server.cli.main", ("numpy",)) == []


def test_testing_presets_load_no_client_or_zmq() -> None:
    """The presets are data; the shared-memory KV (client, zmq) loads on first use."""
    assert (
        _loaded_after("lmc_server.testing", ("lmc_server.client", "lmc_server.testing.kv", "zmq"))
        == []
    )
