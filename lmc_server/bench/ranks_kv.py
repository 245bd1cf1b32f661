"""One rank's KV cache in ``lmcache bench ranks``, its chunk slots and byte checks.

Every rank fills its KV with the same seeded random bytes, so a rank can check bytes
another rank stored: :meth:`RankKV.mismatch` compares region B (where retrieves write)
with region A (what was stored) exactly where a retrieve writes, and
:meth:`RankKV.poison` zeroes region B first so a retrieve that writes nothing fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lmc_server.bench.common import GeometryArgs
from lmc_server.bench.ranks_config import REGION_A, REGION_B
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.cache.layout import RegistrationLayout, build_layout
from lmc_server.testing.presets import KVGeometry


class Slots:
    """Block ids of chunk slots: slot ``s`` of region ``R`` in a group of ``bpc`` blocks
    per chunk is blocks ``(R * chunks + s) * bpc ..+ bpc``."""

    def __init__(self, geometry: KVGeometry, chunks: int, chunk_size: int) -> None:
        self.chunks = chunks
        self.bpc = {g.name: blocks_per_chunk(g, chunk_size) for g in geometry.groups
                    if g.cached}

    def blocks(self, group: str, region: int, slots: np.ndarray, first: int = 0,
               count: int | None = None) -> np.ndarray:
        bpc = self.bpc[group]
        n = bpc - first if count is None else count
        base = (region * self.chunks + np.asarray(slots, dtype=np.int64)) * bpc + first
        return (base[:, None] + np.arange(n)).reshape(-1)

    def ids(self, region: int, slots: np.ndarray) -> dict[str, np.ndarray]:
        return {g: self.blocks(g, region, slots).astype(np.int32) for g in self.bpc}


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
        self.layout: RegistrationLayout = build_layout(self.kv.geometry.groups,
                                                       self.chunk_size, separate=True)

    # -- byte checks ----------------------------------------------------------------------

    def _views(self, group: str) -> list[Any]:
        g = self.kv.group(group)
        out = []
        for spec in g.layers:
            if self.cuda:
                t = self.kv.tensors[spec.buffer]
                out.append(t.as_strided((g.num_blocks, spec.page_bytes),
                                        (spec.block_stride, 1), spec.offset))
            else:
                arr = self.kv.segments[spec.buffer].array
                out.append(np.ndarray((g.num_blocks, spec.page_bytes), np.uint8, arr,
                                      spec.offset, (spec.block_stride, 1)))
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

    def mismatch(self, src: np.ndarray, dst: np.ndarray, one_request: bool = True
                 ) -> tuple[int, int]:
        """``(mismatched, checked)`` bytes of B[dst] against A[src] where a retrieve of
        these chunks writes (see :meth:`_written`)."""
        bad, checked = 0, 0
        acc: Any = None
        for sec, pos in self._written(len(src), one_request):
            if not len(pos):
                continue
            a = self._section_blocks(sec, REGION_A, src[pos.start:])
            b = self._section_blocks(sec, REGION_B, dst[pos.start:])
            for view in self._views(sec.group_name):
                checked += a.size * view.shape[1]
                if self.cuda:
                    import torch

                    ia = torch.as_tensor(a, device=view.device)
                    ib = torch.as_tensor(b, device=view.device)
                    d = (view.index_select(0, ia) != view.index_select(0, ib)).sum()
                    acc = d if acc is None else acc + d
                else:
                    bad += int(np.count_nonzero(view[a] != view[b]))
        if acc is not None:
            bad += int(acc.item())
        return bad, checked

    def poison(self, dst: np.ndarray) -> None:
        """Zero B[dst] so that a retrieve that writes nothing cannot pass the check."""
        for sec, pos in self._written(len(dst), True):
            b = self._section_blocks(sec, REGION_B, dst[pos.start:])
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
