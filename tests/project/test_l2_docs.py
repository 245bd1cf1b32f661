"""docs/l2.md's figures, measured from the codec: the bytes a value
adds to its object, the key's size, and a meaning for every ``invalid`` reason."""

from __future__ import annotations

import re
from pathlib import Path

from lmc_server.tiers import codec

DOC = (Path(__file__).resolve().parents[2] / "docs" / "l2.md").read_text()


def _figures(pattern: str) -> set[int]:
    found = {int(n) for n in re.findall(pattern, DOC)}
    assert found, f"docs/l2.md no longer says {pattern!r}"
    return found


def test_the_header_and_key_sizes_in_the_doc_are_the_codecs() -> None:
    space, chunk_key = bytes(range(16)), bytes(range(32))
    for size in (0, 1, 4096):
        payload = memoryview(bytes(size))
        added = len(codec.encode_value(space, chunk_key, 3, payload)) - size
        assert _figures(r"header is (\d+) bytes") == {added}
        assert _figures(r"(\d+) bytes longer than its object") == {added}
        assert _figures(r"(\d+) bytes of header") == {added}
    assert _figures(r"the (\d+)-byte key") == {len(codec.l2_key(space, chunk_key))}


def test_every_invalid_reason_has_a_meaning_in_the_doc() -> None:
    for reason in codec.Invalid:
        row = re.search(rf"^\s*\| `{reason.value}` \| (.+) \|$", DOC, re.MULTILINE)
        assert row is not None and len(row.group(1)) > 20, reason
