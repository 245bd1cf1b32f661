"""A worker's KV cache in GPU memory (torch tensors), for GPU tests and benchmarks.

``CudaKV`` has the interface of :class:`lmc_server.testing.kv.ShmKV`: one tensor per
buffer of a :class:`KVGeometry`, exported with
:func:`lmc_server.client.cuda.export_tensor`, seeded random contents (two processes on
the same kind of GPU agree on them), and host copies of pages for byte-exact checks.
``raw_copy_gbps`` measures the reference every engine is held against: a plain pinned
``cudaMemcpy`` of the same number of bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lmc_server.buffers import CudaIpcBuffer
from lmc_server.client.cuda import export_tensor
from lmc_server.testing.kv import KVCache
from lmc_server.testing.presets import KVGeometry


def device_arch(device: int = 0) -> str:
    """``sm90`` for compute capability 9.0, ``sm100`` for 10.x, else ``sm<major><minor>``."""
    major, minor = torch.cuda.get_device_capability(device)
    return "sm100" if major == 10 else f"sm{major}{minor}"


class CudaKV(KVCache):
    """GPU buffers for ``geometry`` on ``device``; close (or ``with``) to free them."""

    def __init__(self, geometry: KVGeometry, device: int = 0) -> None:
        self.geometry = geometry
        self.device = torch.device("cuda", device)
        self.tensors: list[torch.Tensor] = [
            torch.zeros(size, dtype=torch.uint8, device=self.device)
            for size in geometry.buffer_sizes
        ]
        self._buffers: list[CudaIpcBuffer] = [export_tensor(t) for t in self.tensors]

    @property
    def buffers(self) -> list[CudaIpcBuffer]:
        return list(self._buffers)

    def fill_random(self, seed: int) -> None:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for t in self.tensors:
            t.copy_(
                torch.randint(0, 256, t.shape, dtype=torch.uint8, device=self.device, generator=gen)
            )
        torch.cuda.synchronize(self.device)

    def fill(self, value: int) -> None:
        for t in self.tensors:
            t.fill_(value)
        torch.cuda.synchronize(self.device)

    def page_tensor(self, group: str, layer: int, block: int) -> torch.Tensor:
        """The page on the GPU (a view, no copy)."""
        spec = self.group(group).layers[layer]
        lo = spec.offset + block * spec.block_stride
        return self.tensors[spec.buffer][lo : lo + spec.page_bytes]

    def page(self, group: str, layer: int, block: int) -> np.ndarray:
        """A host copy of one page."""
        return self.page_tensor(group, layer, block).cpu().numpy()

    def pages(self, group: str, blocks: Sequence[int]) -> bytes:
        """Concatenated pages of ``blocks`` over every layer of ``group`` (one host copy)."""
        g = self.group(group)
        idx = torch.as_tensor(list(blocks), dtype=torch.int64, device=self.device)
        parts = []
        for spec in g.layers:
            t = self.tensors[spec.buffer]
            n = g.num_blocks
            view = t.as_strided((n, spec.page_bytes), (spec.block_stride, 1), spec.offset)
            parts.append(view.index_select(0, idx).reshape(-1))
        return bytes(torch.cat(parts).cpu().numpy().tobytes())

    def close(self) -> None:
        self._buffers.clear()
        self.tensors.clear()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def raw_copy_gbps(nbytes: int, direction: str, device: int = 0, iters: int = 10) -> float:
    """GB/s (1e9 B/s) of a contiguous pinned-host <-> device copy of ``nbytes``.

    ``direction`` is ``"d2h"``, ``"h2d"`` or ``"both"`` (one copy each way at once on
    two streams; the total of both is reported). Timed with CUDA events after warm-up.
    """
    if direction not in ("d2h", "h2d", "both"):
        raise ValueError(f"direction {direction!r}: expected d2h, h2d or both")
    dev = torch.device("cuda", device)
    with torch.cuda.device(dev):
        host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        gpu = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]
        streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]

        def once() -> None:
            if direction in ("d2h", "both"):
                with torch.cuda.stream(streams[0]):
                    host[0].copy_(gpu[0], non_blocking=True)
            if direction in ("h2d", "both"):
                with torch.cuda.stream(streams[1]):
                    gpu[1].copy_(host[1], non_blocking=True)

        main = torch.cuda.current_stream(dev)
        for s in streams:
            s.wait_stream(main)
        for _ in range(2):
            once()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for s in streams:
            main.wait_stream(s)
        start.record(main)
        for s in streams:
            s.wait_stream(main)
        for _ in range(iters):
            once()
        for s in streams:
            main.wait_stream(s)
        end.record(main)
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        total = nbytes * iters * (2 if direction == "both" else 1)
        return total / seconds / 1e9
