"""No pickle, exec, eval or recv_pyobj anywhere in the package (design rule 5).

Scans the parsed source of every module (not just text, so docstrings and comments that
mention the names do not count, and aliases like ``from pickle import loads`` do).
"""

from __future__ import annotations

import ast
from pathlib import Path

import lmc_server

FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
FORBIDDEN_CALLS = {"exec", "eval", "__import__"}


def offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [
                f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                out.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name in FORBIDDEN_CALLS:
                out.append(f"{name}() at line {node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr in ("recv_pyobj", "send_pyobj"):
            out.append(f".{node.attr} at line {node.lineno}")
    return [f"{path}: {o}" for o in out]


def test_package_has_no_untrusted_deserialization_or_exec() -> None:
    root = Path(lmc_server.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 20
    found = [o for f in files for o in offences(f)]
    assert not found, "\n".join(found)


def test_the_scanner_catches_what_it_claims(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom marshal import loads\nx = eval('1')\nsock.recv_pyobj()\nexec('pass')\n"
    )
    assert len(offences(bad)) == 5
