"""The CPU exporter names a tensor's own shared-memory segment, never a closed one.

A process that runs engines one after another (vLLM's tests, a restarted engine in one
interpreter) may close a segment without unregistering it; a later mapping can sit at
its old addresses. The tensor there must be exported as part of its own segment (or
refused), not as the closed one, whose descriptor and name are gone.
"""

from __future__ import annotations

import pytest

from lmc_server.client.shm import ShmSegment
from lmc_server.integration.exporters import (
    ShmExporter,
    register_shm_segment,
    unregister_shm_segment,
)


class _At:
    """A CPU tensor as the exporter sees it: its first element's address."""

    is_cuda = False

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr


def test_a_closed_segment_never_names_a_tensor_at_its_old_addresses() -> None:
    a = ShmSegment(1 << 16)
    register_shm_segment(a)
    base = int(a.array.ctypes.data)
    try:
        found = ShmExporter().export(_At(base + 64))
        assert found.spec == a.spec and found.base_ptr == base
        a.close()  # closed, not unregistered
        with pytest.raises(ValueError, match="not inside a registered"):
            ShmExporter().export(_At(base + 64))
        b = ShmSegment(1 << 16)
        register_shm_segment(b)
        try:
            b_base = int(b.array.ctypes.data)
            got = ShmExporter().export(_At(b_base + 8))
            assert got.spec == b.spec and got.base_ptr == b_base
        finally:
            unregister_shm_segment(b)
            b.close()
    finally:
        unregister_shm_segment(a)
        a.close()
