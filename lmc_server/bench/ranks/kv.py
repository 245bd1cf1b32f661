"""One rank's KV cache in ``lmcache bench ranks``, its chunk slots and byte checks.

Every rank fills its KV with the same seeded random bytes, so a rank can check bytes
another rank stored: :meth:`RankKV.mismatch` compares region B (where retrieves write)
with region A (what was stored) exactly where a retrieve writes, and
:meth:`RankKV.poison` zeroes region B first so a retrieve that writes nothing fails.

Data-parallel engines store many prompts from the same region-A slots, so each page
also carries its prompt's tag (:meth:`RankKV.tag`, before the store): a mismatch check
given the prompt expects that tag in the first ``TAG_BYTES`` of every page and region
A's bytes after it, which no other prompt's object has.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmc_server.bench.common import GeometryArgs
from lmc_server.bench.ranks.config import REGION_A, REGION_B, TAG_BYTES
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.layout import RegistrationLayout, build_layout
from lmc_server.testing.presets import KVGeometry


class Slots:
    """Block ids of chunk slots: slot ``s`` of region ``R`` in a group of ``bpc`` blocks
    per chunk is blocks ``(R * chunks + s) * bpc ..+ bpc``."""

    def __init__(self, geometry: KVGeometry, chunks: int, chunk_size: int) -> None:
        self.chunks = chunks
        self.bpc = {g.name: blocks_per_chunk(g, chunk_size) for g in geometry.groups if g.cached}

    def blocks(
        self, group: str, region: int, slots: np.ndarray, first: int = 0, count: int | None = None
    ) -> np.ndarray:
        bpc = self.bpc[group]
        n = bpc - first if count is None else count
        base = (region * self.chunks + np.asarray(slots, dtype=np.int64)) * bpc + first
        return (base[:, None] + np.arange(n)).reshape(-1)

    def ids(self, region: int, slots: np.ndarray) -> dict[str, np.ndarray]:
        return {g: self.blocks(g, region, slots).astype(np.int32) for g in self.bpc}


def tag_bytes(prompt: int, positions: np.ndarray) -> np.ndarray:
    """``(len(positions), TAG_BYTES)`` tags of chunks ``positions`` of ``prompt``: two
    little-endian words ``prompt + 1`` and ``position + 1``, never all zero (poison)."""
    words = np.empty((len(positions), 2), dtype="<u8")
    words[:, 0] = prompt + 1
    words[:, 1] = np.asarray(positions, dtype=np.int64) + 1
    return words.view(np.uint8).reshape(len(positions), TAG_BYTES)


class RankKV:
    """The KV of rank ``cfg["rank"]`` (shm, or CUDA on GPU ``rank % device count``),
    filled with the seeded bytes every rank shares; ``cfg`` is what the parent sends."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.rank: int = cfg["rank"]
        self.chunk_size: int = cfg["chunk_size"]
        self.cuda = cfg["backend"] == "cuda"
        gargs = GeometryArgs(**cfg["geometry"])
        self.device = 0
        self.device_count = 0
        if self.cuda:
            import torch

            from lmc_server.testing.cuda_kv import CudaKV, device_arch

            self.device_count = torch.cuda.device_count()
            self.device = self.rank % self.device_count
            torch.cuda.set_device(self.device)
            gargs = GeometryArgs(**{**cfg["geometry"], "arch": device_arch(self.device)})
            self.kv: Any = CudaKV(gargs.build(cfg["num_blocks"]), device=self.device)
        else:
            from lmc_server.testing.kv import ShmKV

            self.kv = ShmKV(gargs.build(cfg["num_blocks"]))
        self.kv.fill_random(cfg["seed"])
        self.slots = Slots(self.kv.geometry, cfg["chunks"], self.chunk_size)
        self.layout: RegistrationLayout = build_layout(
            self.kv.geometry.groups, self.chunk_size, separate=True
        )

    # -- byte checks ----------------------------------------------------------------------

    def _views(self, group: str) -> list[Any]:
        g = self.kv.group(group)
        out = []
        for spec in g.layers:
            if self.cuda:
                t = self.kv.tensors[spec.buffer]
                out.append(
                    t.as_strided(
                        (g.num_blocks, spec.page_bytes), (spec.block_stride, 1), spec.offset
                    )
                )
            else:
                arr = self.kv.segments[spec.buffer].array
                out.append(
                    np.ndarray(
                        (g.num_blocks, spec.page_bytes),
                        np.uint8,
                        arr,
                        spec.offset,
                        (spec.block_stride, 1),
                    )
                )
        return out

    def _written(self, n: int, one_request: bool) -> list[tuple[Any, range]]:
        """``(section, chunk positions)`` written by one retrieve of ``n`` chunks
        (``one_request``), or by ``n`` single-chunk retrieves (every section)."""
        out = []
        for og in self.layout.object_groups:
            for sec in og.sections:
                first = 0
                if sec.is_window and one_request:
                    first = max(0, n - self.layout.windows[sec.window_tokens])
                out.append((sec, range(first, n)))
        return out

    def _section_blocks(self, sec: Any, region: int, slots: np.ndarray) -> np.ndarray:
        return self.slots.blocks(sec.group_name, region, slots, sec.first_block, sec.n_blocks)

    def tag(self, slots: np.ndarray, prompt: int) -> None:
        """Write the tag of chunk ``k`` of ``prompt`` at the start of every cached page of
        region-A slot ``slots[k]`` (done before the store that reads these slots)."""
        for group, bpc in self.slots.bpc.items():
            blocks: Any = self.slots.blocks(group, REGION_A, slots)
            tags: Any = tag_bytes(prompt, np.repeat(np.arange(len(slots)), bpc))
            if self.cuda:
                import torch

                blocks = torch.as_tensor(blocks, device=f"cuda:{self.device}")
                tags = torch.as_tensor(tags, device=f"cuda:{self.device}")
            for view in self._views(group):
                w = min(TAG_BYTES, view.shape[1])
                if self.cuda:
                    view[:, :w].index_copy_(0, blocks, tags[:, :w])
                else:
                    view[blocks, :w] = tags[:, :w]
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def mismatch(
        self, src: np.ndarray, dst: np.ndarray, one_request: bool = True, prompt: int | None = None
    ) -> tuple[int, int]:
        """``(mismatched, checked)`` bytes of B[dst] against A[src] where a retrieve of
        these chunks writes (see :meth:`_written`); with ``prompt``, chunk ``k``'s pages
        are expected to start with its tag (:meth:`tag`) instead of A's bytes."""
        bad, checked = 0, 0
        acc: Any = None
        for sec, pos in self._written(len(src), one_request):
            if not len(pos):
                continue
            a = self._section_blocks(sec, REGION_A, src[pos.start :])
            b = self._section_blocks(sec, REGION_B, dst[pos.start :])
            tags: Any = (
                None
                if prompt is None
                else tag_bytes(prompt, np.repeat(np.arange(pos.start, len(src)), sec.n_blocks))
            )
            if self.cuda:
                import torch

                dev = f"cuda:{self.device}"
                ia, ib = torch.as_tensor(a, device=dev), torch.as_tensor(b, device=dev)
                if tags is not None:
                    tags = torch.as_tensor(tags, device=dev)
            for view in self._views(sec.group_name):
                checked += a.size * view.shape[1]
                w = min(TAG_BYTES, view.shape[1])
                if self.cuda:
                    want = view.index_select(0, ia)
                    if tags is not None:
                        want[:, :w] = tags[:, :w]
                    d = (want != view.index_select(0, ib)).sum()
                    acc = d if acc is None else acc + d
                else:
                    want = view[a]
                    if tags is not None:
                        want[:, :w] = tags[:, :w]
                    bad += int(np.count_nonzero(want != view[b]))
        if acc is not None:
            bad += int(acc.item())
        return bad, checked

    def poison(self, dst: np.ndarray, one_request: bool = True) -> None:
        """Zero B[dst] where a retrieve of these chunks writes (``one_request``: one
        request of them all, else every section of every chunk), so that a retrieve
        that writes nothing cannot pass the check."""
        for sec, pos in self._written(len(dst), one_request):
            b = self._section_blocks(sec, REGION_B, dst[pos.start :])
            for view in self._views(sec.group_name):
                if self.cuda:
                    import torch

                    view.index_fill_(0, torch.as_tensor(b, device=view.device), 0)
                else:
                    view[b] = 0
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.kv.close()
