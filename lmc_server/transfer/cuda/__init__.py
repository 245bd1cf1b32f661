"""The CUDA transfer engine: CUDA IPC, copy engines and CuPy kernels, a pinned pool.

``engine`` (:class:`~lmc_server.transfer.cuda.engine.CudaEngine`, what ``--backend
cuda`` builds), ``jobs`` (a job's life on a lane), ``lanes``, ``wait``, the plans
(``units``, ``plan``, ``dma_plan``, ``dma_reuse``), ``launch``, ``batch``, ``kernels``
(NVRTC), ``ipc``, ``pool`` and ``gpu_activity`` (whether other processes compute).
Nothing is imported here: ``wait``, ``dma_reuse`` and ``gpu_activity`` need no CuPy and
are unit-tested without it. The engine's lines are logged as ``lmc_server.transfer.cuda``.
"""
