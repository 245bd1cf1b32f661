"""Backend selection: ``auto`` picks cuda when a GPU and CuPy are usable, else cpu."""

from __future__ import annotations

import importlib.util
import logging

from lmc_server.transfer.base import TransferEngine

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # noqa: BLE001 - any CUDA/driver failure means "no GPU here"
        return False


def make_engine(
    backend: str, copy_threads: int = 0, cuda_copy_mode: str = "auto", cuda_staging_mb: int = 32
) -> TransferEngine:
    """Instantiate the engine for ``--backend``; raises RuntimeError if unusable."""
    if backend == "auto":
        backend = "cuda" if cuda_available() else "cpu"
        log.info("backend auto: using %s", backend)
    if backend == "cpu":
        from lmc_server.transfer.cpu import CpuEngine

        return CpuEngine(copy_threads)
    if backend == "null":
        from lmc_server.transfer.null import NullEngine

        log.warning("backend null: no bytes are moved; for benchmarks only")
        return NullEngine()
    if backend == "cuda":
        if not cuda_available():
            raise RuntimeError(
                "--backend cuda: CuPy is not installed or sees no GPU "
                "(pip install 'lmc-server[gpu]')"
            )
        try:
            from lmc_server.transfer.cuda.engine import CudaEngine
        except ImportError as e:
            raise RuntimeError(f"--backend cuda is not available: {e}") from None
        engine: TransferEngine = CudaEngine(
            copy_mode=cuda_copy_mode, staging_half_bytes=cuda_staging_mb << 20
        )
        return engine
    raise RuntimeError(f"unknown backend {backend!r}")
