"""A worker's KV cache in shared memory: buffers, random contents, page access.

``ShmKV`` creates one segment per buffer of a :class:`KVGeometry`, fills it with random
bytes (seeded, so two processes can agree on contents), and reads or compares pages,
which is what byte-exact tests and benchmarks need.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from lmc_server.cache.geometry import GroupSpec
from lmc_server.client.core import Registration
from lmc_server.client.shm import ShmSegment
from lmc_server.testing.presets import KVGeometry

#: Words drawn per slice by :func:`fill_random_bytes` (8 MiB: no temporary as large as
#: the array).
_FILL_WORDS = 1 << 20


def fill_random_bytes(arrays: Sequence[np.ndarray], seed: int) -> None:
    """Fill each uint8 array, in order, with seeded random bytes: the same ``seed`` gives
    the same bytes in every process.

    Drawn as 64-bit words straight from the bit generator into the array, a slice at a
    time: every byte is still uniform and independent, at about a third of the CPU of
    ``integers(0, 256, dtype=uint8)`` plus a copy (0.5 s instead of 1.4 s for the
    702 MiB of a 512-block DeepSeek-V4.1-Flash KV cache, measured here); tests fill
    hundreds of MiB each.
    """
    bits = np.random.PCG64(seed)
    for a in arrays:
        n = a.shape[0]
        whole = n - n % 8
        for lo in range(0, whole, _FILL_WORDS * 8):
            hi = min(lo + _FILL_WORDS * 8, whole)
            a[lo:hi].view(np.uint64)[:] = bits.random_raw((hi - lo) // 8)
        if whole < n:
            a[whole:] = np.frombuffer(bits.random_raw(1).tobytes()[: n - whole], np.uint8)


class KVCache:
    """What every test KV cache shares: its geometry, groups, registration arguments.

    Subclasses hold the buffers (shared memory here, GPU memory in
    :class:`lmc_server.testing.cuda_kv.CudaKV`) and define ``buffers`` and ``close``.
    """

    geometry: KVGeometry

    @property
    def buffers(self) -> list[Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def group(self, name: str) -> GroupSpec:
        for g in self.geometry.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def register_kwargs(self, **overrides: Any) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model=self.geometry.model,
            kv_dtype=self.geometry.kv_dtype,
            arch=self.geometry.arch,
            groups=self.geometry.groups,
            buffers=self.buffers,
        )
        kw.update(overrides)
        return kw

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmKV(KVCache):
    """Shared-memory buffers for ``geometry``; close (or use ``with``) to free them.

    The segments are the client library's (:mod:`lmc_server.client.shm`): nameless
    but while a registration is sent, so they register any number of times (several
    clients, a restarted server) and a process killed with SIGKILL leaves nothing in
    ``/dev/shm`` (worker processes a test kills).
    """

    def __init__(self, geometry: KVGeometry) -> None:
        self.geometry = geometry
        self.segments: list[ShmSegment] = []
        try:
            for size in geometry.buffer_sizes:
                self.segments.append(ShmSegment(size))
        except BaseException:
            self.close()
            raise

    @property
    def buffers(self) -> list[Any]:
        return [s.spec for s in self.segments]

    def fill_random(self, seed: int) -> None:
        fill_random_bytes([s.array for s in self.segments], seed)

    def fill(self, value: int) -> None:
        for s in self.segments:
            s.array[:] = value

    def page(self, group: str, layer: int, block: int) -> np.ndarray:
        """A view of one page (no copy)."""
        g = self.group(group)
        spec = g.layers[layer]
        lo = spec.offset + block * spec.block_stride
        return self.segments[spec.buffer].array[lo : lo + spec.page_bytes]

    def pages(self, group: str, blocks: Sequence[int]) -> bytes:
        """Concatenated pages of ``blocks`` over every layer of ``group``."""
        g = self.group(group)
        return b"".join(
            self.page(group, li, b).tobytes() for li in range(len(g.layers)) for b in blocks
        )

    def close(self) -> None:
        for s in self.segments:
            s.close()
        self.segments.clear()


def block_ids_for(
    reg: Registration, n_chunks: int, rng: np.random.Generator | None = None, first_block: int = 0
) -> dict[str, np.ndarray]:
    """Block ids for ``n_chunks`` chunks per cached group: random distinct ids if ``rng``,
    else consecutive from ``first_block``."""
    out: dict[str, np.ndarray] = {}
    for g in reg.groups:
        if not g.cached:
            continue
        n = n_chunks * reg.blocks_per_chunk(g)
        if n > g.num_blocks:
            raise ValueError(f"group {g.name!r}: {n} blocks needed, {g.num_blocks} exist")
        if rng is not None:
            out[g.name] = rng.permutation(g.num_blocks)[:n].astype(np.int32)
        else:
            out[g.name] = (np.arange(n, dtype=np.int32) + first_block) % g.num_blocks
    return out


def assert_same_pages(
    reg: Registration,
    src: ShmKV,
    src_ids: dict[str, np.ndarray],
    dst: ShmKV,
    dst_ids: dict[str, np.ndarray],
    n: int,
    window_chunks: int = 1,
) -> None:
    """The byte oracle of a retrieve of ``n`` chunks from ``src_ids`` into ``dst_ids``:
    full groups compared for every chunk, sliding-window groups for the window of the
    last ``window_chunks`` chunks (what one retrieve of a prefix writes)."""
    for g in reg.groups:
        if not g.cached:
            continue
        bpc = reg.blocks_per_chunk(g)
        a = np.asarray(src_ids[g.name]).reshape(n, bpc)
        b = np.asarray(dst_ids[g.name]).reshape(n, bpc)
        if g.kind == "sliding_window":
            keep = -(-g.window_tokens // g.tokens_per_block)
            a, b = a[-window_chunks:, bpc - keep :], b[-window_chunks:, bpc - keep :]
        assert src.pages(g.name, a.ravel().tolist()) == dst.pages(g.name, b.ravel().tolist()), (
            f"group {g.name}: retrieved bytes differ"
        )
