"""The CPU attention backend over the native paged kernels (``engine/cpu/csrc/paged_decode.c`` and
``paged_prefill.c``, built and loaded by :mod:`kvrelay.engine.cpu.native`).

Decode attention on the CPU is memory-bound: each step reads every running sequence's cached K/V
once per layer. Done with torch ops it cannot avoid gathering the paged blocks into a contiguous
buffer first (a read and a write of the whole context) and then reading that again in SDPA,
whose CPU kernel is tuned for long query blocks rather than one query row: at batch 64 x 500
tokens that is ~5x the bytes and time of reading the cache once (measured, ~150M demo model).
The C kernel reads each sequence's K/V rows straight out of the paged cache through its block
table, once.
"""

from __future__ import annotations

import torch

from kvrelay.engine.attention.metadata import AttentionMetadata
from kvrelay.engine.attention.sdpa import prefill_attention, zero_padding
from kvrelay.engine.cpu.native import available, load

__all__ = ["available", "native_attention", "paged_decode", "paged_prefill"]

# Fewest keys in one decode work item: the kernel cuts a sequence's context into partitions of
# at least this many keys, so a small batch with long contexts still gives every thread work
# (the partial softmaxes merge exactly).
MIN_PART_TOKENS = 256


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, ctx_lens: torch.Tensor, out: torch.Tensor,
                 block_size: int, scale: float, window: int | None) -> torch.Tensor:
    """Decode attention of ``q [N, H, D]`` over the paged caches (flat ``[slots, KVH, D]``),
    sequence ``i`` seeing its first ``ctx_lens[i]`` keys through ``block_tables[i]`` (int32,
    ``[N, W]``). Writes and returns ``out [N, H, D]``; every tensor contiguous fp32 on CPU."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    n, h, d = q.shape
    kvh = k_cache.shape[1]
    assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous()
    assert q.dtype == torch.float32 and block_tables.dtype == torch.int32
    rc = lib.kvr_paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        ctx_lens.data_ptr(), out.data_ptr(), n, h, kvh, d, block_size, block_tables.shape[1],
        scale, window or 0, MIN_PART_TOKENS, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native paged decode attention failed ({rc})")
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, spans: torch.Tensor, out: torch.Tensor,
                  block_size: int, scale: float, window: int | None) -> torch.Tensor:
    """Causal attention of prefill spans over the paged caches. ``spans`` is int32 ``[3, S]``:
    each span's first row in ``q [T, H, D]``, its row count, and the keys visible to its last
    row (cached prefix plus its new tokens, whose K/V are already in the caches);
    ``block_tables`` int32 ``[S, W]``. Writes the spans' rows of ``out [T, H, D]``."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    h, d = q.shape[1], q.shape[2]
    assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous()
    assert q.dtype == torch.float32 and block_tables.dtype == torch.int32
    assert spans.dtype == torch.int32 and spans.is_contiguous()
    n = spans.shape[1]
    rc = lib.kvr_paged_prefill_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        spans[0].data_ptr(), spans[1].data_ptr(), spans[2].data_ptr(), out.data_ptr(), n, h,
        k_cache.shape[1], d, block_size, block_tables.shape[1], scale, window or 0,
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native paged prefill attention failed ({rc})")
    return out


def native_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, window: int | None,
) -> torch.Tensor:
    """The CPU backend: every prefill span of the step in one call of the paged prefill kernel
    (torch SDPA where the head size is not a multiple of 16), every decode in one call of the
    paged decode kernel."""
    out = torch.empty_like(q)
    if meta.prefill_spans is not None:
        assert meta.prefill_tables is not None
        paged_prefill(q, k_cache, v_cache, meta.prefill_tables, meta.prefill_spans, out,
                      meta.block_size, scale, window)
    else:
        prefill_attention(q, k, v, k_cache, v_cache, meta, scale, window, out)
    if meta.decode_lens is not None:
        p, e = meta.num_prefill_tokens, meta.num_prefill_tokens + meta.num_decodes
        assert meta.decode_tables is not None
        paged_decode(q[p:e], k_cache, v_cache, meta.decode_tables, meta.decode_lens, out[p:e],
                     meta.block_size, scale, window)
    zero_padding(out, meta)
    return out
