"""Every module the docs tell a reader to run, and every module the package starts as a
subprocess by name, exists; every micro-benchmark answers ``--help``.

The benchmarks live in subpackages (docs/architecture.md, "bench/"); a module that
moves leaves behind command lines in the docs and module names in strings
(``JsonLineProcess("lmc_server.bench.ranks.worker", ...)``) that no import checks.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lmc_server

PACKAGE = Path(lmc_server.__file__).parent
ROOT = PACKAGE.parent
MICRO = sorted(p.stem for p in (PACKAGE / "bench" / "micro").glob("*.py") if p.stem != "__init__")
#: ``python -m lmc_server...`` in prose and shell; a name followed by ``.<`` is a pattern
#: (``micro.<name>``), not a module.
RUN_MODULE = re.compile(r"python3? -m (lmc_server(?:\.\w+)*)(\.<)?")
MODULE_STRING = re.compile(r"lmc_server(?:\.\w+)+")


def _exists(name: str, run: bool = False) -> bool:
    """``name`` is a module, or with ``run`` something ``python -m`` runs (a package
    then needs its ``__main__``)."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and run and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
    except ModuleNotFoundError:
        return False
    return spec is not None


def test_modules_the_docs_and_scripts_run_exist() -> None:
    texts = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "scripts").iterdir()),
        *sorted((ROOT / "deploy").rglob("*")),
    ]
    named: dict[str, str] = {}
    for path in texts:
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name, pattern in RUN_MODULE.findall(line):
                if not pattern:
                    named.setdefault(name, f"{path.relative_to(ROOT)}:{n}")
    assert len(named) >= 5, sorted(named)
    missing = [
        f"{where}: {name}" for name, where in sorted(named.items()) if not _exists(name, run=True)
    ]
    assert not missing, "no such module:\n" + "\n".join(missing)


def test_module_names_in_the_package_strings_exist() -> None:
    """A string constant among a call's arguments that is a whole dotted ``lmc_server.``
    name (a subprocess's ``-m`` target, a worker started by name) names a module."""
    named: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(call, ast.Call):
                continue
            for node in (n for arg in call.args for n in ast.walk(arg)):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and MODULE_STRING.fullmatch(node.value)
                ):
                    named.setdefault(node.value, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(named) >= 3, sorted(named)
    missing = [f"{where}: {name}" for name, where in sorted(named.items()) if not _exists(name)]
    assert not missing, "no such module:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", [m for m in MICRO if m != "request_cost"])
def test_each_micro_benchmark_answers_help(name: str) -> None:
    """``request_cost`` takes no arguments (it runs on any argv), so it is left out."""
    out = subprocess.run(
        [sys.executable, "-m", f"lmc_server.bench.micro.{name}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:"), out.stdout
