"""The CPU attention backend over the native paged kernels (``engine/cpu/csrc/paged_decode.c`` and
``paged_prefill.c``, built and loaded by :mod:`kvrelay.engine.cpu.native`).

Decode attention on the CPU is memory-bound: each step reads every running sequence's cached K/V
once per layer. Done with torch ops it cannot avoid gathering the paged blocks into a contiguous
buffer first (a read and a write of the whole context) and then reading that again in SDPA,
whose CPU kernel is tuned for long query blocks rather than one query row: at batch 64 x 500
tokens that is ~5x the bytes and time of reading the cache once (measured, ~150M demo model).
The C kernel reads each sequence's K/V rows straight out of the paged cache through its block
table, once.

The queries and outputs are fp32; the cache is fp32 or bf16 (half the bytes a decode step reads),
widened to fp32 as it is read: a bf16 cache gives the fp32 result over its values, as if it
were widened first. Both kernels take attention sinks (gpt-oss: a logit per query head in each
softmax's denominator), added to each head's sum before the output is divided by it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrelay.engine.attention.metadata import AttentionMetadata, LastLayerRows, SdpaMetadata
from kvrelay.engine.attention.sdpa import (
    SdpaBackend,
    prefill_attention,
    prefill_spans,
    zero_padding,
)
from kvrelay.engine.attention.step import DecodeRows, StepLayout, padded_tables
from kvrelay.engine.cpu.native import available, load

__all__ = ["NativeBackend", "NativeMetadata", "available", "native_attention", "paged_decode",
           "paged_prefill"]


@dataclass
class NativeMetadata(SdpaMetadata):
    """The native kernels' view: every decode at once (int32 ``[N, W]`` block tables and ``[N]``
    context lengths, the new token included) and, where the head size suits the prefill kernel,
    every prefill span at once (int32 ``[3, S]``: first row, rows, visible keys; and ``[S, W]``
    block tables; the spans then need no ``ctx_slots`` gather). Otherwise the prefill spans go
    through SDPA as :class:`SdpaMetadata`'s."""

    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefill_spans: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_lens is None else self.decode_lens.numel()

    def to_device(self, h2d: Callable[[torch.Tensor], torch.Tensor]) -> NativeMetadata:
        super().to_device(h2d)
        for name in ("decode_tables", "decode_lens", "prefill_spans", "prefill_tables"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, h2d(t))
        return self

# The kernels' kv_dtype for each cache dtype (csrc/abi.h's KVR_DTYPE_*).
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def kv_dtype(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The kernels' code for the caches' dtype (both the same, fp32 or bf16)."""
    code = KV_DTYPES.get(k_cache.dtype)
    assert code is not None and v_cache.dtype == k_cache.dtype, (k_cache.dtype, v_cache.dtype)
    return code


# Fewest keys in one decode work item: the kernel cuts a sequence's context into partitions of
# at least this many keys, so a small batch with long contexts still gives every thread work
# (the partial softmaxes merge exactly).
MIN_PART_TOKENS = 256


def _sinks(sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The kernels' sinks: fp32, contiguous, one per query head (or None)."""
    if sinks is None:
        return None
    assert sinks.shape == (heads,), (sinks.shape, heads)
    return sinks.to(torch.float32).contiguous()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, ctx_lens: torch.Tensor, out: torch.Tensor,
                 block_size: int, scale: float, window: int | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of ``q [N, H, D]`` over the paged caches (flat ``[slots, KVH, D]``),
    sequence ``i`` seeing its first ``ctx_lens[i]`` keys through ``block_tables[i]`` (int32,
    ``[N, W]``), with a sink logit per query head where ``sinks`` ``[H]`` is given. Writes and
    returns ``out [N, H, D]``; every tensor contiguous on CPU, ``q`` and ``out`` fp32, the
    caches fp32 or bf16."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    n, h, d = q.shape
    kvh = k_cache.shape[1]
    s = _sinks(sinks, h)
    assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and out.dtype == torch.float32
    assert q.dtype == torch.float32 and block_tables.dtype == torch.int32
    rc = lib.kvr_paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        ctx_lens.data_ptr(), out.data_ptr(), n, h, kvh, d, block_size, block_tables.shape[1],
        scale, window or 0, MIN_PART_TOKENS, torch.get_num_threads(),
        kv_dtype(k_cache, v_cache), None if s is None else s.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native paged decode attention failed ({rc})")
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, spans: torch.Tensor, out: torch.Tensor,
                  block_size: int, scale: float, window: int | None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of prefill spans over the paged caches. ``spans`` is int32 ``[3, S]``:
    each span's first row in ``q [T, H, D]``, its row count, and the keys visible to its last
    row (cached prefix plus its new tokens, whose K/V are already in the caches);
    ``block_tables`` int32 ``[S, W]``; ``sinks`` ``[H]`` or None. Writes the spans' rows of
    ``out [T, H, D]``. ``q`` and ``out`` fp32, the caches fp32 or bf16."""
    lib = load()
    assert lib is not None, "native kernels unavailable"
    h, d = q.shape[1], q.shape[2]
    s = _sinks(sinks, h)
    assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and out.dtype == torch.float32
    assert q.dtype == torch.float32 and block_tables.dtype == torch.int32
    assert spans.dtype == torch.int32 and spans.is_contiguous()
    n = spans.shape[1]
    rc = lib.kvr_paged_prefill(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        spans[0].data_ptr(), spans[1].data_ptr(), spans[2].data_ptr(), out.data_ptr(), n, h,
        k_cache.shape[1], d, block_size, block_tables.shape[1], scale, window or 0,
        torch.get_num_threads(), kv_dtype(k_cache, v_cache), None if s is None else s.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native paged prefill attention failed ({rc})")
    return out


def native_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: NativeMetadata, scale: float, window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU backend: every prefill span of the step in one call of the paged prefill kernel
    (torch SDPA where the head size is not a multiple of 16), every decode in one call of the
    paged decode kernel."""
    out = torch.empty_like(q)
    if meta.prefill_spans is not None:
        assert meta.prefill_tables is not None
        paged_prefill(q, k_cache, v_cache, meta.prefill_tables, meta.prefill_spans, out,
                      meta.block_size, scale, window, sinks)
    else:
        prefill_attention(q, k, v, k_cache, v_cache, meta, scale, window, out, sinks)
    if meta.decode_lens is not None:
        p, e = meta.num_prefill_tokens, meta.num_prefill_tokens + meta.num_decodes
        assert meta.decode_tables is not None
        paged_decode(q[p:e], k_cache, v_cache, meta.decode_tables, meta.decode_lens, out[p:e],
                     meta.block_size, scale, window, sinks)
    zero_padding(out, meta)
    return out


class NativeBackend(SdpaBackend):
    """The native paged kernels (CPU, fp32 activations over an fp32 or bf16 cache). The prefill
    kernel's vectors are 16 floats wide: other head sizes run their prefill spans through SDPA
    (:meth:`bind_cache` decides), which widens a bf16 cache's rows as it gathers them. A cache
    of another dtype (fp16) runs every step through SDPA (``native_kv`` False)."""

    name = "native"

    def __init__(self) -> None:
        super().__init__()
        self.native_prefill = True
        self.native_kv = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(meta, NativeMetadata):  # a cache the kernels do not read
            return super().__call__(q, k, v, k_cache, v_cache, meta, scale, window, sinks)
        return native_attention(q, k, v, k_cache, v_cache, meta, scale, window, sinks)

    def bind_cache(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        super().bind_cache(num_kv_heads, head_dim, dtype, device)
        self.native_kv = dtype in KV_DTYPES
        self.native_prefill = self.native_kv and head_dim % 16 == 0
        # The last layer on the rows read alone needs the spans as one tensor.
        self.prunes_last_layer = self.native_prefill

    def metadata(self, step: StepLayout) -> SdpaMetadata:
        if not self.native_kv:
            return super().metadata(step)
        bs, p = step.block_size, step.num_prefills
        spans = prefill_spans(step, gather=not self.native_prefill)
        meta = NativeMetadata(step.slot_mapping, step.num_prefill_tokens, bs, prefills=spans)
        if spans and self.native_prefill:  # one kernel call over every prefill span
            meta.prefill_spans = torch.tensor(
                [[sp.q_start for sp in spans], [sp.q_len for sp in spans],
                 [sp.ctx_len for sp in spans]], dtype=torch.int32)
            meta.prefill_tables = padded_tables(
                step.block_tables[:p], max(-(-sp.ctx_len // bs) for sp in spans), torch.int32)
        lens = step.ctx_lens[p:]
        if lens:  # one kernel call over every decode
            meta.decode_lens = torch.tensor(lens, dtype=torch.int32)
            meta.decode_tables = padded_tables(step.block_tables[p:], -(-max(lens) // bs),
                                               torch.int32)
        meta.workspace = self.workspace(meta.gather_rows())
        return meta

    def decode_metadata(self, rows: DecodeRows) -> SdpaMetadata:
        if not self.native_kv:
            return super().decode_metadata(rows)
        return NativeMetadata(rows.slot_mapping, 0, rows.block_size,
                              decode_lens=rows.seq_lens, decode_tables=rows.block_tables)

    def last_layer_rows(self, meta: AttentionMetadata, sampling: list[int]) \
            -> dict[int, int] | None:
        if not self.prunes_last_layer:
            return None
        assert isinstance(meta, NativeMetadata)
        return last_layer_rows(meta, sampling)


def last_layer_rows(meta: NativeMetadata, sampling: list[int]) -> dict[int, int] | None:
    """Set ``meta.last_layer`` to the rows the last layer must run past its K/V: the last row of
    each prefill span in ``sampling`` (indices into ``meta.prefills``), then every decode.
    Returns each such row's index among them, or None (and sets nothing) when that would be
    every real row. Needs ``prefill_spans`` wherever there are prefill spans."""
    p, nd = meta.num_prefill_tokens, meta.num_decodes
    rows = [meta.prefills[j].q_start + meta.prefills[j].q_len - 1 for j in sampling]
    rows.extend(range(p, p + nd))
    if len(rows) == p + nd:
        return None
    sub = NativeMetadata(meta.slot_mapping, len(sampling), meta.block_size,
                         decode_tables=meta.decode_tables, decode_lens=meta.decode_lens)
    if sampling:
        assert meta.prefill_spans is not None and meta.prefill_tables is not None
        idx = torch.tensor(sampling, dtype=torch.long)
        n = len(sampling)
        sub.prefill_spans = torch.stack([
            torch.arange(n, dtype=torch.int32), torch.ones(n, dtype=torch.int32),
            meta.prefill_spans[2].index_select(0, idx)]).contiguous()
        sub.prefill_tables = meta.prefill_tables.index_select(0, idx).contiguous()
    meta.last_layer = LastLayerRows(torch.tensor(rows, dtype=torch.long), sub)
    return {r: i for i, r in enumerate(rows)}
