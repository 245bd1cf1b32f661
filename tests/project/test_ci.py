"""CI runs the README's test command: .ci/run and the README name the same pytest
invocation, so a change to one (a flag, a plugin) cannot silently leave the other."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pytest_command(text: str) -> str:
    """The ``pytest ...`` after ``pip install ... '.[test]' &&`` on one line."""
    found = re.findall(r"pip install (?:-q )?-e '\.\[test\]' && (pytest[^\n]*)", text)
    assert len(found) == 1, found
    return str(found[0]).strip()


def test_ci_runs_the_readme_test_command() -> None:
    readme = _pytest_command((ROOT / "README.md").read_text())
    ci = _pytest_command((ROOT / ".ci" / "run").read_text())
    assert ci == readme
    assert "-n auto" in ci and "--timeout" in ci


def test_ci_checks_the_installed_wheel() -> None:
    """CI installs the package the way users do (a wheel, outside the checkout) and runs
    the commands and the README's Python example from there: an editable install
    imports the tree, so it cannot see a module the wheel leaves out."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nbash .ci/check-wheel.sh\n" in ci
    script = (ROOT / ".ci" / "check-wheel.sh").read_text()
    for step in ("pip wheel", "-m venv", "lmcache --help", "lmcache ping", "lmcache stats"):
        assert step in script, step
