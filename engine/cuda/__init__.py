"""The CUDA platform: what the engine does differently on a GPU, in one package.

- ``flash``: the flash-attn backend (imported only once chosen: the ``gpu`` extra);
- ``graphs``: CUDA graphs for decode-only steps.

The engine's shared code reaches it through the platform hook (:mod:`kvrelay.engine.platform`).
"""
