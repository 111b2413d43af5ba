"""Attention backends over the paged KV cache: torch SDPA (CPU, fp32) and flash-attn (CUDA)."""

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


def select_backend(name: str, device: torch.device) -> tuple[str, AttentionFn]:
    """Pick the attention function for ``device``: 'auto' takes flash-attn only on CUDA with the
    ``gpu`` extra installed; the CUDA module is never imported otherwise."""
    if name == "flash" or (name == "auto" and device.type == "cuda" and flash_available()):
        if device.type != "cuda":
            raise ValueError("attention_backend=flash needs a CUDA device; use sdpa on CPU")
        if not flash_available():
            raise ImportError(
                "attention_backend=flash needs flash-attn: pip install 'kvrelay[gpu]'")
        from kvrelay.engine.attention.flash import flash_attention

        return "flash", flash_attention
    if name not in ("auto", "sdpa"):
        raise ValueError(f"unknown attention backend {name!r}")
    return "sdpa", sdpa_attention
