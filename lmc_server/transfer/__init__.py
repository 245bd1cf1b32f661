"""Transfer engines: move pages between workers' KV buffers and the L1 pool.

One interface (:class:`lmc_server.transfer.base.TransferEngine`), two engines:
``cpu`` (POSIX shared memory, numpy copies; tests and CPU-only hosts) and ``cuda`` (the
subpackage: CUDA IPC, CuPy kernels, pinned pool). CuPy is imported by the cuda engine only.
"""
