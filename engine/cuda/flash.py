"""flash-attn backend for CUDA (the optional ``gpu`` extra). flash-attn is imported only by
:meth:`FlashBackend.load`, once this backend was chosen: never on the CPU.

All sequences of a step (prefill chunks and decodes alike) go through one
``flash_attn_varlen_func`` call. With blocks of a multiple of 256 tokens (the platform picks 256
on CUDA when this flash-attn has ``block_table``) the kernel reads K/V straight from the paged
cache through each sequence's block table. Otherwise the visible keys are first gathered from
the paged cache into one packed tensor, which works for any block size but copies every
sequence's K/V once per layer. flash-attn's causal mask is bottom-right aligned, so a chunk over
a cached prefix is masked correctly either way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrelay.engine.attention.backend import AttentionBackend
from kvrelay.engine.attention.metadata import AttentionMetadata
from kvrelay.engine.attention.step import DecodeRows, StepLayout, cache_slots, padded_tables
from kvrelay.engine.kv_cache import as_blocks, slot_rows


@dataclass
class FlashMetadata(AttentionMetadata):
    """flash-attn's view of a step: the varlen batch's prefix sums and either the block tables
    (the paged kernel) or every visible slot, sequence after sequence (the gather path)."""

    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    gather_slots: torch.Tensor | None = None
    flash_block_table: torch.Tensor | None = None  # int32 [N, W]: paged flash-attn, no gather
    decodes: int = 0

    @property
    def num_decodes(self) -> int:
        return self.decodes

    def to_device(self, h2d: Callable[[torch.Tensor], torch.Tensor]) -> FlashMetadata:
        super().to_device(h2d)
        for name in ("cu_seqlens_q", "cu_seqlens_k", "gather_slots", "flash_block_table"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, h2d(t))
        return self


def supports_paged(varlen: Callable[..., torch.Tensor]) -> bool:
    return "block_table" in inspect.signature(varlen).parameters


class FlashBackend(AttentionBackend):
    """``paged``: the kernel reads the paged cache through block tables (flash-attn >= 2.5)."""

    name = "flash"

    def __init__(self, paged: bool, varlen: Callable[..., torch.Tensor] | None = None):
        self.paged = paged
        self._varlen = varlen

    @classmethod
    def load(cls) -> FlashBackend:
        """The backend over the installed flash-attn (raises ``ImportError``/``OSError`` where
        it does not load: a wheel built against another torch)."""
        from flash_attn import flash_attn_varlen_func

        return cls(supports_paged(flash_attn_varlen_func), flash_attn_varlen_func)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(meta, FlashMetadata) and self._varlen is not None
        if sinks is not None:  # supports_sinks is False: the runner never sends them here
            raise ValueError("flash-attn's varlen kernels have no attention sinks")
        return flash_attention(self._varlen, q, k_cache, v_cache, meta, scale, window)

    def metadata(self, step: StepLayout) -> FlashMetadata:
        q_lens, k_lens, tables, bs = step.q_lens, step.ctx_lens, step.block_tables, \
            step.block_size
        i32 = torch.int32
        meta = FlashMetadata(step.slot_mapping, step.num_prefill_tokens, bs,
                             decodes=len(q_lens) - step.num_prefills)
        if self.paged:
            meta.flash_block_table = padded_tables(tables, -(-max(k_lens) // bs), dtype=i32)
        else:
            slots = cache_slots(tables, k_lens, bs)
            meta.gather_slots = torch.cat([slots[j, :k] for j, k in enumerate(k_lens)])
        meta.cu_seqlens_q = torch.tensor([0, *q_lens], dtype=i32).cumsum(0, dtype=i32)
        meta.cu_seqlens_k = torch.tensor([0, *k_lens], dtype=i32).cumsum(0, dtype=i32)
        meta.max_seqlen_q, meta.max_seqlen_k = max(q_lens), max(k_lens)
        return meta

    def decode_metadata(self, rows: DecodeRows) -> FlashMetadata:
        return FlashMetadata(rows.slot_mapping, 0, rows.block_size,
                             cu_seqlens_q=rows.cu_seqlens_q, cu_seqlens_k=rows.cu_seqlens_k,
                             max_seqlen_q=1, max_seqlen_k=rows.max_seqlen_k,
                             flash_block_table=rows.block_tables,
                             decodes=rows.seq_lens.shape[0])


def flash_attention(
    varlen: Callable[..., torch.Tensor], q: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: FlashMetadata, scale: float, window: int | None,
) -> torch.Tensor:
    assert meta.cu_seqlens_q is not None
    window_size = (window - 1, 0) if window is not None else (-1, -1)
    if meta.flash_block_table is not None:
        # [blocks, block_size, kv_heads, d] views, no copy (heads first: strided, which
        # flash-attn reads through its strides)
        return varlen(
            q, as_blocks(k_cache, meta.block_size), as_blocks(v_cache, meta.block_size),
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale, causal=True, window_size=window_size,
            block_table=meta.flash_block_table,
        )
    assert meta.gather_slots is not None
    keys = slot_rows(k_cache, meta.gather_slots)
    values = slot_rows(v_cache, meta.gather_slots)
    return varlen(
        q, keys, values,
        cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale, causal=True, window_size=window_size,
    )
