"""The README's Python example, as a reader copies it: extracted from README.md, run in
a fresh interpreter against a real ``lmcache server`` (the cpu backend), it prints what
its comments say it prints, uses only the public client package and leaves nothing in
/dev/shm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lmc_server.testing.process import ServerProcess

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"


def readme_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.S | re.M)
    assert len(blocks) == 1, "README.md holds one Python example"
    return str(blocks[0])


def promised_output(code: str) -> list[str]:
    """What each ``print(...)  # text`` line says it prints, in order."""
    return [m.group(1) for m in re.finditer(r"^\s*print\(.*\)\s+# (.+)$", code, re.M)]


def test_readme_example_runs_and_prints_what_it_says(server: ServerProcess) -> None:
    code = readme_example()
    assert DEFAULT_ENDPOINT in code, "the example talks to the default endpoint"
    assert "lmc_server.testing" not in code, "the example uses the public client only"
    promised = promised_output(code)
    assert len(promised) >= 3, promised
    before = set(os.listdir("/dev/shm"))
    res = subprocess.run(
        [sys.executable, "-c", code.replace(DEFAULT_ENDPOINT, server.endpoint)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines() == promised
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("lmc-")}
