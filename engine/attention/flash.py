"""flash-attn backend for CUDA (the optional ``gpu`` extra). Never imported on CPU.

All sequences of a step (prefill chunks and decodes alike) go through one
``flash_attn_varlen_func`` call. Visible keys are gathered from the paged cache into one packed
tensor, which works for any block size (upstream flash-attn's own paged path needs blocks of 256
tokens). flash-attn's causal mask is bottom-right aligned, so a chunk over a cached prefix is
masked correctly.
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func

from kvrelay.engine.attention.metadata import AttentionMetadata


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, window: int | None,
) -> torch.Tensor:
    assert meta.gather_slots is not None and meta.cu_seqlens_q is not None
    keys = k_cache.index_select(0, meta.gather_slots)
    values = v_cache.index_select(0, meta.gather_slots)
    return flash_attn_varlen_func(
        q, keys, values,
        cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale, causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
    )
