"""The CPU platform: what the engine does differently on a CPU, in one package.

- ``platform``: :class:`~kvrelay.engine.cpu.platform.CpuPlatform`, the hook the shared engine
  code calls (:mod:`kvrelay.engine.platform`);
- ``native``: the C kernels (``csrc/``), built per x86-64 ISA level and loaded with ctypes;
- ``gemm``, ``kernel_choice``: the panel GEMM, and which linear kernel (panels, oneDNN, both)
  a model's weights are packed for at load, timed once and kept;
- ``attention``: the native paged attention backend and its metadata;
- ``fused_decode``: whole decoder layers of a decode step in one native call;
- ``prefetch_tuner``: the GEMM's next-panel prefetch, chosen online;
- ``hugepages``: weights placed on transparent huge pages;
- ``thread_pinning``: the engine's OpenMP threads, one per CPU.
"""
