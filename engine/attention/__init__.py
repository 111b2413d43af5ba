"""Attention backends over the paged KV cache: native paged kernels (CPU, fp32), torch SDPA (any
device) and flash-attn (CUDA)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from kvrelay.engine.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    LastLayerRows,
    PrefillSpan,
    current_metadata,
    forward_context,
    group_by_length,
)
from kvrelay.engine.attention.sdpa import sdpa_attention, write_kv

__all__ = ["AttentionFn", "AttentionMetadata", "DecodeGroup", "LastLayerRows", "PrefillSpan",
           "current_metadata", "flash_supports_paged", "forward_context", "group_by_length",
           "select_backend", "write_kv"]

logger = logging.getLogger(__name__)

AttentionFn = Callable[..., torch.Tensor]


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_supports_paged() -> bool:
    """Whether the installed flash-attn's varlen kernel reads a paged cache (``block_table``,
    flash-attn >= 2.5). Only asked once the flash backend was chosen."""
    from kvrelay.engine.cuda.flash import supports_paged

    return supports_paged()


def _import_flash() -> AttentionFn | None:
    """The flash-attn backend, or None with a warning when the module is installed but does not
    load (a wheel built against another torch: undefined symbols in its CUDA extension)."""
    try:
        from kvrelay.engine.cuda.flash import flash_attention
    except (ImportError, OSError) as e:
        logger.warning("flash-attn is installed but does not load (%s: %s); using torch SDPA. "
                       "Rebuild it against this torch: make install-gpu", type(e).__name__, e)
        return None
    return flash_attention


def select_backend(name: str, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> tuple[str, AttentionFn]:
    """Pick the attention function for ``device``: 'auto' takes flash-attn only on CUDA, in
    fp16/bf16 (flash-attn has no fp32 kernels), with the ``gpu`` extra installed and loadable
    (the CUDA module is never imported otherwise), and on the CPU in fp32 the native paged
    kernels when they build here (else torch SDPA)."""
    if name == "flash":
        if device.type != "cuda":
            raise ValueError("attention_backend=flash needs a CUDA device; use sdpa on CPU")
        if dtype not in FLASH_DTYPES:
            raise ValueError(f"attention_backend=flash needs float16 or bfloat16, got {dtype}")
        if not flash_available():
            raise ImportError(
                "attention_backend=flash needs flash-attn: make install-gpu")
        fn = _import_flash()
        if fn is None:
            raise ImportError("attention_backend=flash: flash-attn does not load (see the log)")
        return "flash", fn
    if name == "auto" and device.type == "cuda" and flash_available():
        if dtype in FLASH_DTYPES:
            fn = _import_flash()
            if fn is not None:
                return "flash", fn
        else:
            logger.info("attention: torch SDPA, flash-attn has no %s kernels", dtype)
    if name not in ("auto", "sdpa", "native"):
        raise ValueError(f"unknown attention backend {name!r}")
    if name in ("auto", "native") and device.type == "cpu" and dtype == torch.float32:
        from kvrelay.engine.cpu import attention as native

        if native.available():
            return "native", native.native_attention
        if name == "native":
            raise RuntimeError("attention_backend=native: the CPU kernels could not be built "
                               "(see the log; a C compiler with OpenMP is needed)")
    elif name == "native":
        raise ValueError("attention_backend=native needs fp32 on the CPU")
    return "sdpa", sdpa_attention
