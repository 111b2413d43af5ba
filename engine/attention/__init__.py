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
    PrefillSpan,
    current_metadata,
    forward_context,
    group_by_length,
)
from kvrelay.engine.attention.sdpa import sdpa_attention, write_kv

__all__ = ["AttentionFn", "AttentionMetadata", "DecodeGroup", "PrefillSpan", "current_metadata",
           "forward_context", "group_by_length", "select_backend", "write_kv"]

logger = logging.getLogger(__name__)

AttentionFn = Callable[..., torch.Tensor]


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def select_backend(name: str, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> tuple[str, AttentionFn]:
    """Pick the attention function for ``device``: 'auto' takes flash-attn only on CUDA with the
    ``gpu`` extra installed (the CUDA module is never imported otherwise), and on the CPU in
    fp32 the native paged kernels when they build here (else torch SDPA)."""
    if name == "flash" or (name == "auto" and device.type == "cuda" and flash_available()):
        if device.type != "cuda":
            raise ValueError("attention_backend=flash needs a CUDA device; use sdpa on CPU")
        if not flash_available():
            raise ImportError(
                "attention_backend=flash needs flash-attn: pip install 'kvrelay[gpu]'")
        from kvrelay.engine.attention.flash import flash_attention

        return "flash", flash_attention
    if name not in ("auto", "sdpa", "native"):
        raise ValueError(f"unknown attention backend {name!r}")
    if name in ("auto", "native") and device.type == "cpu" and dtype == torch.float32:
        from kvrelay.engine.attention import native

        if native.available():
            return "native", native.native_attention
        if name == "native":
            raise RuntimeError("attention_backend=native: the CPU kernels could not be built "
                               "(see the log; a C compiler with OpenMP is needed)")
    elif name == "native":
        raise ValueError("attention_backend=native needs fp32 on the CPU")
    return "sdpa", sdpa_attention
