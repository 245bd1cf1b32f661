"""A vLLM fixture's KV cache in GPU memory, for the connector's GPU test.

:class:`CudaBacking` is the GPU side of :class:`lmc_server.testing.kvfixture.Backing`:
one uint8 allocation, as vLLM allocates its KV cache, with the fixture's layer views
rebuilt over it by :func:`~lmc_server.testing.kvfixture.torch_views`. torch is
imported here; CPU-only tests use :class:`~lmc_server.testing.kvfixture.ShmBacking`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lmc_server.client.cuda import stream_done
from lmc_server.testing.kvfixture import KVFixture, PageCopy, first_difference_np, torch_views


class CudaBacking:
    """A vLLM fixture's backing allocation in GPU memory: one uint8 tensor, as vLLM
    allocates its KV cache, with the layer views rebuilt over it
    (:class:`lmc_server.testing.kvfixture.Backing`).

    Comparisons run on the GPU first, then again on host copies; the two must agree.
    """

    def __init__(self, size_bytes: int, device: int = 0) -> None:
        self.size_bytes = size_bytes
        self.device = torch.device("cuda", device)
        self.tensor = torch.zeros(size_bytes, dtype=torch.uint8, device=self.device)

    def views(self, fx: KVFixture) -> dict[str, torch.Tensor]:
        if fx.backing_size_bytes > self.size_bytes:
            raise ValueError(f"{fx.name} needs {fx.backing_size_bytes} bytes")
        return torch_views(fx, self.tensor)

    def fill_random(self, seed: int) -> None:
        """Seeded bytes, written on the current stream (stores wait for it: ``ready``)."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self.tensor.copy_(
            torch.randint(
                0, 256, (self.size_bytes,), dtype=torch.uint8, device=self.device, generator=gen
            )
        )

    def snapshot(self) -> torch.Tensor:
        return self.tensor.clone()

    def apply(self, before: torch.Tensor, copies: Sequence[PageCopy]) -> torch.Tensor:
        out = before.clone()
        for c in copies:
            out[c.dst : c.dst + c.nbytes] = before[c.src : c.src + c.nbytes]
        return out

    def first_difference(self, a: torch.Tensor, b: torch.Tensor) -> int | None:
        where = torch.nonzero(a != b)
        on_gpu = int(where[0, 0]) if where.numel() else None
        on_host = first_difference_np(a.cpu().numpy(), b.cpu().numpy())
        if on_gpu != on_host:
            raise RuntimeError(f"GPU comparison says {on_gpu}, host comparison {on_host}")
        return on_host

    def ready(self) -> Callable[[], None]:
        """Waits until the writes queued so far on the current stream are done."""
        return stream_done(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        del self.tensor
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def __enter__(self) -> CudaBacking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
