"""The CUDA platform: what the engine does differently on a GPU, in one package.

- ``platform``: :class:`~kvrelay.engine.cuda.platform.CudaPlatform`, the hook the shared engine
  code calls (:mod:`kvrelay.engine.platform`);
- ``flash``: the flash-attn backend and its metadata (flash-attn itself is imported only once
  chosen: the ``gpu`` extra);
- ``graphs``: CUDA graphs for decode-only steps;
- ``memory``: the KV cache's budget within the GPU's memory, and the paged kernel's block size.
"""
