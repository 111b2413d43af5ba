"""Paged attention with torch SDPA: the CPU backend (any device torch supports).

Prefill segments attend causally over their cached prefix plus their new tokens, one SDPA call
per segment. Decodes come in groups of similar context length (so padding stays bounded), one
padded SDPA call per group: their cached blocks are gathered into
``[B, kv_heads, ctx, head_dim]`` and the query heads of each KV group are laid along the query
axis, so grouped-query attention needs no copy of K/V per query head.

Attention sinks (gpt-oss): each query head ``h`` has a learned logit ``sinks[h]`` that joins the
softmax's denominator and attends to nothing, ``p_j = exp(s_j) / (sum_i exp(s_i) +
exp(sinks[h]))``. SDPA has no such term, so a layer with sinks attends explicitly
(:func:`sink_attention`: scores, a log-sum-exp that takes the sink in, weights, values), in
chunks of query rows that bound its scores' memory, with the same spans, groups and masks.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvrelay.engine.attention.backend import AttentionBackend
from kvrelay.engine.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
    SdpaMetadata,
    group_by_length,
)
from kvrelay.engine.attention.step import DecodeRows, StepLayout, cache_slots, padded_tables
from kvrelay.engine.kv_cache import as_blocks
from kvrelay.engine.pointwise import write_kv_rows

logger = logging.getLogger(__name__)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ``[T, kv_heads, head_dim]`` into the caches (rows past
    ``len(slot_mapping)`` pad the step to a bucketed size and are not written): flat slot
    rows, or blocks (heads first: ``kv_cache.plane_view``)."""
    if k_cache.dim() == 3:
        write_kv_rows(k_cache, v_cache, k, v, slot_mapping)
        return
    n, bs = slot_mapping.shape[0], k_cache.shape[1]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    k_cache[blocks, offsets] = k[:n].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[:n].to(v_cache.dtype)


def zero_padding(out: torch.Tensor, meta: AttentionMetadata) -> None:
    """Zero the rows of ``out`` past the step's real tokens (padding no attention covers), so
    the linears after it see zeros rather than whatever the allocator left there."""
    n = meta.num_prefill_tokens + meta.num_decodes
    if out.shape[0] > n:
        out[n:].zero_()


def widened(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows in the queries' dtype (a bf16 cache under fp32 activations: SDPA
    takes one dtype)."""
    return kv if kv.dtype == dtype else kv.to(dtype)


def stored(kv: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``kv`` rounded as a cache of ``cache_dtype`` stores it, in its own dtype."""
    return kv if kv.dtype == cache_dtype else kv.to(cache_dtype).to(kv.dtype)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: SdpaMetadata, scale: float, window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, H, D]``, ``k/v [T, KVH, D]``; caches are flat ``[slots, KVH, D]``; ``sinks``
    ``[H]`` (or None). Returns ``[T, H, D]``. The new K/V must already be in the caches."""
    out = torch.empty_like(q)
    prefill_attention(q, k, v, k_cache, v_cache, meta, scale, window, out, sinks)
    grouped_decode_attention(q, k_cache, v_cache, meta, scale, window, out, sinks)
    zero_padding(out, meta)
    return out


# Scores one chunk of a sink attention holds at most (fp32: 64 MiB).
SINK_CHUNK_SCORES = 1 << 24


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per query head: ``q [B, H, L, D]``, ``k/v [B, KVH, S, D]``
    (``H`` a multiple of ``KVH``: query head ``h`` reads KV head ``h // (H / KVH)``), ``mask``
    boolean (True: attend) broadcastable to ``[B, H, L, S]`` or None (every key), ``sinks
    [H]``. Returns ``[B, H, L, D]`` in ``q``'s dtype; scores and softmax in fp32. Each query
    head's rows of a KV group are laid along one axis (as the grouped decode does), so K/V are
    never copied per query head."""
    b, h, n, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    out = q.new_empty(b, h, n, v.shape[-1])
    sink = sinks.float().view(1, h, 1)
    kt = k.transpose(-1, -2)
    step = max(1, SINK_CHUNK_SCORES // max(1, b * h * s))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        qc = q[:, :, r0:r1].reshape(b, kvh, g * (r1 - r0), d)
        scores = torch.matmul(qc, kt).float().mul_(scale).view(b, h, r1 - r0, s)
        if mask is not None:
            m = mask if mask.shape[-2] == 1 else mask[..., r0:r1, :]
            scores.masked_fill_(~m, float("-inf"))
        # log of the denominator: the keys' exp-sum and the sink's, stably
        lse = torch.logaddexp(torch.logsumexp(scores, dim=-1), sink)
        probs = torch.exp(scores.sub_(lse.unsqueeze(-1))).to(v.dtype)
        o = torch.matmul(probs.view(b, kvh, g * (r1 - r0), s), v)
        out[:, :, r0:r1] = o.view(b, h, r1 - r0, -1)
    return out


def causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[q_len, ctx_len]``: the last ``q_len`` positions each see themselves and every
    earlier key."""
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    return torch.arange(ctx_len, device=device)[None, :] <= qpos


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: SdpaMetadata, scale: float, window: int | None, out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """The prefill spans of the step (rows ``[0, num_prefill_tokens)``), one SDPA call each
    (with ``sinks``: one :func:`sink_attention`)."""
    gqa = q.shape[1] != k.shape[1]
    for span in meta.prefills:
        qs = q[span.q_start:span.q_start + span.q_len].transpose(0, 1).unsqueeze(0)
        if span.ctx_slots is None:
            # The keys as the cache holds them (rounded, in a narrower cache): a prompt then
            # attends over the same values whether its prefix was computed now or found cached.
            ks = stored(k[span.q_start:span.q_start + span.q_len], k_cache.dtype)
            vs = stored(v[span.q_start:span.q_start + span.q_len], v_cache.dtype)
        else:
            ks = widened(meta.gather_slots(k_cache, span.ctx_slots, 0), q.dtype)
            vs = widened(meta.gather_slots(v_cache, span.ctx_slots, 1), q.dtype)
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        mask = span.mask(window, q.device)
        if sinks is not None:
            if mask is None:
                mask = causal_mask(span.q_len, span.ctx_len, q.device)
            o = sink_attention(qs, ks, vs, mask, scale, sinks)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                               is_causal=mask is None, scale=scale,
                                               enable_gqa=gqa)
        out[span.q_start:span.q_start + span.q_len] = o.squeeze(0).transpose(0, 1)


def grouped_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: SdpaMetadata, scale: float, window: int | None, out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """The step's decodes (rows from ``num_prefill_tokens`` on), one padded SDPA call (with
    ``sinks``: one :func:`sink_attention`) per group of similar context lengths."""
    if not meta.decode_groups:
        return
    num_heads, kv_heads, head_dim = q.shape[1], k_cache.shape[-2], q.shape[2]
    group = num_heads // kv_heads
    bs = meta.block_size
    # Whole blocks at a time: [blocks, block_size, KVH, D] rows are block_size x larger
    # than slot rows, and index_select copies large rows much faster.
    k_blocks, v_blocks = as_blocks(k_cache, bs), as_blocks(v_cache, bs)
    p = meta.num_prefill_tokens
    for g in meta.decode_groups:
        start = p + g.q_start
        # [B, H, D] -> [B, KVH, group, D]: each KV head's query heads become its queries.
        qd = q[start:start + g.count].view(g.count, kv_heads, group, head_dim)
        shape = (g.count, g.block_tables.shape[1] * bs, kv_heads, head_dim)
        flat = g.block_tables.reshape(-1)
        kd = widened(meta.gather(k_blocks, flat, 0).view(shape), q.dtype).transpose(1, 2)
        vd = widened(meta.gather(v_blocks, flat, 1).view(shape), q.dtype).transpose(1, 2)
        if sinks is not None:
            o = sink_attention(qd.view(g.count, num_heads, 1, head_dim), kd, vd,
                               g.mask(window, bs), scale, sinks)
        else:
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask(window, bs),
                                               scale=scale)
        out[start:start + g.count] = o.reshape(g.count, num_heads, head_dim)


def prefill_spans(step: StepLayout, gather: bool) -> list[PrefillSpan]:
    """The step's prefill chunks as spans; with ``gather`` a chunk over a cached prefix lists
    its visible keys' slots (gathered from the cache), else none do."""
    bs, starts = step.block_size, step.q_starts()
    spans = []
    for j in range(step.num_prefills):
        n, ctx = step.q_lens[j], step.ctx_lens[j]
        slots = cache_slots([step.block_tables[j]], [ctx], bs)[0] if gather and ctx > n else None
        spans.append(PrefillSpan(starts[j], n, ctx, slots))
    return spans


class SdpaBackend(AttentionBackend):
    """torch SDPA over the paged cache (any device): gathers what it reads into a workspace it
    keeps across steps."""

    name = "sdpa"
    supports_sinks = True

    def __init__(self) -> None:
        self._row = 0  # elements of one cache slot (kv heads x head dim)
        self._dtype, self._device = torch.float32, torch.device("cpu")
        self._scratch: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        assert isinstance(meta, SdpaMetadata)
        return sdpa_attention(q, k, v, k_cache, v_cache, meta, scale, window, sinks)

    def bind_cache(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        self._row, self._dtype, self._device = num_kv_heads * head_dim, dtype, device

    def metadata(self, step: StepLayout) -> SdpaMetadata:
        meta = SdpaMetadata(step.slot_mapping, step.num_prefill_tokens, step.block_size,
                            prefills=prefill_spans(step, gather=True))
        meta.decode_groups = decode_groups(step)
        meta.workspace = self.workspace(meta.gather_rows())
        return meta

    def decode_metadata(self, rows: DecodeRows) -> SdpaMetadata:
        # one padded group; its mask is rebuilt per (eager) call
        n = rows.seq_lens.shape[0]
        return SdpaMetadata(rows.slot_mapping, 0, rows.block_size,
                            decode_groups=[DecodeGroup(0, n, rows.seq_lens, rows.block_tables)])

    def workspace(self, rows: int) -> torch.Tensor | None:
        """The gather scratch for ``rows`` cache slots of K and of V; grows, never shrinks (its
        high-water mark is what one step needs at most)."""
        if rows == 0:
            return None
        need = 2 * rows * self._row
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(int(need * 1.25), dtype=self._dtype, device=self._device)
            logger.debug("attention workspace: %.1f MiB",
                         self._scratch.numel() * self._scratch.element_size() / 2**20)
        return self._scratch


def decode_groups(step: StepLayout) -> list[DecodeGroup]:
    """The step's decodes (ascending context lengths, mostly: a hybrid KV layout's windowed
    group sees each cut to its window) in groups of similar length, each with its block tables
    padded to the group's longest."""
    p, bs = step.num_prefills, step.block_size
    lens = step.ctx_lens[p:]
    groups, start = [], 0
    for count in group_by_length(lens, bs):
        run = lens[start:start + count]
        tables = padded_tables(step.block_tables[p + start:p + start + count], -(-max(run) // bs))
        groups.append(DecodeGroup(start, count, torch.tensor(run, dtype=torch.long), tables))
        start += count
    return groups
