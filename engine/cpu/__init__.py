"""The CPU platform: what the engine does differently on a CPU, in one package.

- ``native``: the C kernels (``csrc/``), built per x86-64 ISA level and loaded with ctypes;
- ``gemm``, ``kernel_choice``: the panel GEMM, and which linear kernel (panels, oneDNN, both)
  a model's weights are packed for at load;
- ``attention``: the native paged attention backend;
- ``fused_decode``: whole decoder layers of a decode step in one native call;
- ``prefetch_tuner``: the GEMM's next-panel prefetch, chosen online;
- ``hugepages``: weights placed on transparent huge pages;
- ``thread_pinning``: the engine's OpenMP threads, one per CPU.

Nothing outside ``engine/`` imports from here; the engine's shared code reaches it through the
platform hook (:mod:`kvrelay.engine.platform`).
"""
