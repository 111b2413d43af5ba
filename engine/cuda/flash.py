"""flash-attn backend for CUDA (the optional ``gpu`` extra). Never imported on CPU.

All sequences of a step (prefill chunks and decodes alike) go through one
``flash_attn_varlen_func`` call. With blocks of a multiple of 256 tokens (the runner picks 256
on CUDA when this flash-attn has ``block_table``) the kernel reads K/V straight from the paged
cache through each sequence's block table. Otherwise the visible keys are first gathered from
the paged cache into one packed tensor, which works for any block size but copies every
sequence's K/V once per layer. flash-attn's causal mask is bottom-right aligned, so a chunk over
a cached prefix is masked correctly either way.
"""

from __future__ import annotations

import inspect

import torch
from flash_attn import flash_attn_varlen_func

from kvrelay.engine.attention.metadata import AttentionMetadata


def supports_paged() -> bool:
    return "block_table" in inspect.signature(flash_attn_varlen_func).parameters


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, window: int | None,
) -> torch.Tensor:
    assert meta.cu_seqlens_q is not None
    window_size = (window - 1, 0) if window is not None else (-1, -1)
    if meta.flash_block_table is not None:
        # [slots, kv_heads, d] -> [blocks, block_size, kv_heads, d]: views, no copy
        paged = (-1, meta.block_size, *k_cache.shape[1:])
        return flash_attn_varlen_func(
            q, k_cache.view(paged), v_cache.view(paged),
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale, causal=True, window_size=window_size,
            block_table=meta.flash_block_table,
        )
    assert meta.gather_slots is not None
    keys = k_cache.index_select(0, meta.gather_slots)
    values = v_cache.index_select(0, meta.gather_slots)
    return flash_attn_varlen_func(
        q, keys, values,
        cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale, causal=True, window_size=window_size,
    )
