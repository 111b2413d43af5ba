"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each token's keys and values come from one small latent: ``kv_a_proj_with_mqa`` maps the hidden
state to ``c`` (``kv_lora_rank``, RMS-normed) and a rope key ``k_pe`` (``qk_rope_head_dim``)
that every head shares; ``kv_b_proj`` maps ``c`` to each head's no-rope key and its value. The
cache keeps only ``[c, rotated k_pe]`` per token (one plane of one "head", ``kv_cache.py``):
for DeepSeek-V3 576 elements a token a layer where its 128 heads' K and V would be 49152.

Two ways to attend over it, both exact:

- prefill spans **up-project** the latents they see (the cached prefix's read back from the
  paged cache, so a chunk after a prefix hit sees what the first chunks wrote) into per-head
  K/V and attend with SDPA: the long-query case, where the per-head K/V are cheaper than
  moving every query into the latent space;
- decode rows **absorb** the up-projections: ``q_nope @ W_UK`` takes each query head into the
  latent space, where it attends over the cached rows as one shared KV head of width
  ``kv_lora_rank + qk_rope_head_dim`` (keys: the whole row; values: the same row, of which the
  first ``kv_lora_rank`` elements are kept), and ``W_UV`` takes the result back to the head's
  value space. That is the backend's own decode attention (on the CPU the native paged
  kernel, grouped-query with every query head on the one KV head), reading the latent plane
  in place.

Rope: DeepSeek rotates pairs of adjacent dimensions ``(x0, x1), (x2, x3), ...``; the rows of
the projections that make the rope parts are de-interleaved at load (:class:`RopeRows`), so the
engine's rotate-half rope gives the same dot products (the cached ``k_pe`` is in that order:
the same on every peer serving the checkpoint). Scores scale by ``qk_head_dim ** -0.5`` times
YaRN's ``mscale`` squared where the config scales its rope (``models/deepseek.py``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.attention import AttentionFn, AttentionMetadata, LastLayerRows
from kvrelay.engine.attention.sdpa import stored, widened
from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.linear import Linear, empty_param
from kvrelay.engine.models.llama import RMSNorm
from kvrelay.engine.models.weights import Cuts, WeightTarget
from kvrelay.engine.pointwise import rope


def deinterleave_rows(t: torch.Tensor, groups: int, group_rows: int, at: int,
                      width: int) -> torch.Tensor:
    """``t`` (``[groups * group_rows, ...]``) with rows ``[at, at + width)`` of each group
    reordered from interleaved pairs to halves: the even rows, then the odd ones."""
    perm = torch.arange(t.shape[0]).view(groups, group_rows)
    part = perm[:, at:at + width].clone()
    perm[:, at:at + width] = torch.cat((part[:, 0::2], part[:, 1::2]), dim=1)
    return t.index_select(0, perm.reshape(-1))


class RopeRows(WeightTarget):
    """A projection whose rope rows (``[at, at + width)`` of each of ``groups`` groups of
    ``group_rows``) are interleaved pairs in the checkpoint: loaded de-interleaved."""

    __slots__ = ("at", "group_rows", "groups", "width")

    def __init__(self, param: torch.Tensor, start: int | None, stop: int | None, *, groups: int,
                 group_rows: int, at: int, width: int):
        super().__init__(param, start, stop)
        self.groups, self.group_rows, self.at, self.width = groups, group_rows, at, width

    def load(self, name: str, tensor: torch.Tensor, cuts: Cuts | None = None) -> None:
        if tensor.shape[0] != self.groups * self.group_rows:
            raise ValueError(f"weight {name!r} has {tensor.shape[0]} rows, expected "
                             f"{self.groups * self.group_rows}")
        super().load(name, deinterleave_rows(tensor, self.groups, self.group_rows, self.at,
                                             self.width), cuts)


def decode_view(meta: AttentionMetadata) -> AttentionMetadata | None:
    """``meta`` restricted to its decodes (their rows from 0), for the absorbed attention: no
    prefill spans, no callbacks; None when the step has no decodes."""
    if not meta.num_decodes:
        return None
    p = meta.num_prefill_tokens
    names = {f.name for f in dataclasses.fields(meta)}
    drop = {k: v for k, v in (("prefills", []), ("prefill_spans", None),
                              ("prefill_tables", None)) if k in names}
    return dataclasses.replace(meta, slot_mapping=meta.slot_mapping[p:], num_prefill_tokens=0,
                               on_kv_written=None, last_layer=None, **drop)


def rows_as_decodes(last: LastLayerRows) -> AttentionMetadata | None:
    """The last layer's rows (``last.meta``: the last row of each sampling prefill span, then
    the decodes) as decodes of one step: a span's last row sees its whole context, as a decode
    does, so the absorbed attention serves them all in one call. None where ``last.meta`` is
    not the native backend's (every row then runs the last layer)."""
    sub = last.meta
    if not hasattr(sub, "prefill_spans"):
        return None
    lens, tables = [], []
    if sub.num_prefill_tokens:
        lens.append(sub.prefill_spans[2])
        tables.append(sub.prefill_tables)
    if sub.decode_lens is not None:
        lens.append(sub.decode_lens)
        tables.append(sub.decode_tables)
    width = max(t.shape[1] for t in tables)
    return dataclasses.replace(
        sub, num_prefill_tokens=0, prefills=[], prefill_spans=None, prefill_tables=None,
        decode_lens=torch.cat(lens), decode_tables=torch.cat(
            [F.pad(t, (0, width - t.shape[1])) for t in tables]), last_layer=None,
        on_kv_written=None)


def span_slots(meta: AttentionMetadata, j: int) -> torch.Tensor:
    """The cache slots of the keys prefill span ``j`` sees (its cached prefix and itself): the
    span's own list where the backend gathered one, else from its block table (the native
    backend's, which reads the cache through tables)."""
    span = meta.prefills[j]
    if span.ctx_slots is not None:
        return span.ctx_slots
    tables = meta.prefill_tables
    bs = meta.block_size
    blocks = tables[j, :-(-span.ctx_len // bs)].long()
    return (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).view(-1)[
        :span.ctx_len]


class MLAttention(nn.Module):
    """One layer's latent attention: ``[T, hidden] -> [T, hidden]``, writing each row's latent
    into the cache (``cache``: flat ``[slots, 1, kv_lora_rank + qk_rope_head_dim]``)."""

    def __init__(self, arch: ModelArch, layer: int, attn_fn: AttentionFn):
        super().__init__()
        self.layer = layer
        self.num_heads = arch.num_heads
        self.nope, self.rope_dim = arch.qk_nope_head_dim, arch.qk_rope_head_dim
        self.v_dim, self.rank = arch.v_head_dim, arch.kv_lora_rank
        self.qk_dim = self.nope + self.rope_dim
        h = arch.num_heads
        # q_a_proj (or q_proj, without a q bottleneck) and kv_a_proj_with_mqa: one GEMM
        self.q_in = arch.q_lora_rank or h * self.qk_dim
        self.in_proj = Linear(arch.hidden_size, self.q_in + self.rank + self.rope_dim,
                              arch.qkv_bias)
        if self.in_proj.bias is not None:
            self.in_proj.bias.data.zero_()  # q_proj has none: its rows stay zero
        self.q_norm = RMSNorm(arch.q_lora_rank, arch.rms_norm_eps) if arch.q_lora_rank else None
        self.q_b = Linear(arch.q_lora_rank, h * self.qk_dim, False) if arch.q_lora_rank else None
        self.kv_norm = RMSNorm(self.rank, arch.rms_norm_eps)
        # kv_b_proj as a plain weight: the decode absorbs its two halves (never packed)
        self.kv_b = empty_param(h * (self.nope + self.v_dim), self.rank)
        self.o = Linear(h * self.v_dim, arch.hidden_size, arch.o_bias)
        self.scale = self.qk_dim ** -0.5  # the model sets YaRN's where it applies
        self.attn_fn = attn_fn
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, decodes: AttentionMetadata | None) -> torch.Tensor:
        """``decodes``: :func:`decode_view` of ``meta`` (built once per step)."""
        t, h = x.shape[0], self.num_heads
        q_in, row = self._latents(x, cos, sin, meta)
        q = q_in if self.q_b is None else self.q_b(self.q_norm(q_in))
        q = q.view(t, h, self.qk_dim)
        q_nope, q_pe = q[..., :self.nope], rope(q[..., self.nope:], cos, sin)
        out = x.new_zeros(t, h, self.v_dim)
        p = meta.num_prefill_tokens
        if p:
            self._prefill(torch.cat((q_nope[:p], q_pe[:p]), dim=-1), row, meta, out)
        if decodes is not None:
            e = p + decodes.num_decodes
            out[p:e] = self._decode(q_nope[p:e], q_pe[p:e], decodes)
        return self.o(out.view(t, h * self.v_dim))

    def forward_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     meta: AttentionMetadata, rows: AttentionMetadata,
                     last: LastLayerRows) -> torch.Tensor:
        """:meth:`forward` for the rows ``last.rows`` only (``[R, hidden]``): every row's latent
        still goes to the cache; those rows' queries attend, absorbed, as the decodes ``rows``
        (:func:`rows_as_decodes`)."""
        q_in, _ = self._latents(x, cos, sin, meta)
        q_in = q_in.index_select(0, last.rows)
        r = q_in.shape[0]
        q = (q_in if self.q_b is None else self.q_b(self.q_norm(q_in)))
        q = q.view(r, self.num_heads, self.qk_dim)
        q_pe = rope(q[..., self.nope:], cos.index_select(0, last.rows),
                    sin.index_select(0, last.rows))
        out = self._decode(q[..., :self.nope], q_pe, rows)
        return self.o(out.reshape(r, self.num_heads * self.v_dim))

    def _latents(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The input projection of every row: its q input (``[T, q_in]``) and its cache row
        ``[c, rotated k_pe]`` (``[T, rank + rope]``), written to the cache."""
        t = x.shape[0]
        q_in, lat, k_pe = self.in_proj(x).split((self.q_in, self.rank, self.rope_dim), dim=-1)
        k_pe = rope(k_pe.reshape(t, 1, self.rope_dim), cos, sin)
        row = torch.cat((self.kv_norm(lat), k_pe.view(t, self.rope_dim)), dim=-1)
        cache = self.cache
        n = meta.slot_mapping.shape[0]
        cache.index_copy_(0, meta.slot_mapping, row[:n].to(cache.dtype).unsqueeze(1))
        if meta.on_kv_written is not None:
            meta.on_kv_written(self.layer)
        return q_in, row

    def up_project(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows ``[n, rank + rope]`` -> per-head keys ``[n, H, qk]`` and values
        ``[n, H, v]``."""
        n, h = lat.shape[0], self.num_heads
        kv = F.linear(lat[:, :self.rank], self.kv_b.to(lat.dtype))
        k_nope, v = kv.view(n, h, self.nope + self.v_dim).split((self.nope, self.v_dim), dim=-1)
        k_pe = lat[:, None, self.rank:].expand(n, h, self.rope_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def _prefill(self, q: torch.Tensor, row: torch.Tensor, meta: AttentionMetadata,
                 out: torch.Tensor) -> None:
        """Each prefill span's queries over its up-projected keys and values: its own rows as
        the cache stores them, or, after a cached prefix, every row it sees from the cache."""
        for j, span in enumerate(meta.prefills):
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.ctx_len == span.q_len:
                lat = stored(row[rows], self.cache.dtype)
            else:
                lat = widened(self.cache.index_select(0, span_slots(meta, j)), q.dtype)
                lat = lat.view(span.ctx_len, -1)
            k, v = self.up_project(lat)
            qs, width = q[rows], max(self.qk_dim, self.v_dim)
            # One head size for all three (zeros: the same scores and values): SDPA's fused CPU
            # kernel takes no other (V3's 192 / 128 and 96 / 64 went to the math path, which
            # took 4x as long on 2048 tokens, 8 heads, 2 threads).
            qs, k, v = (F.pad(t, (0, width - t.shape[-1])).transpose(0, 1) for t in (qs, k, v))
            mask = span.mask(None, q.device)
            o = F.scaled_dot_product_attention(qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                               attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale)
            out[rows] = o[0, ..., :self.v_dim].transpose(0, 1)

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The absorbed attention of decode rows: ``[n, H, v]``."""
        h = self.num_heads
        w = self.kv_b.to(q_nope.dtype).view(h, self.nope + self.v_dim, self.rank)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :self.nope])  # [H, n, rank]
        ql = torch.cat((q_lat.transpose(0, 1), q_pe), dim=-1).contiguous()
        o = self.attn_fn(ql, ql, ql, self.cache, self.cache, meta, self.scale, None)
        o_lat = o[..., :self.rank].transpose(0, 1)  # [H, n, rank]
        return torch.bmm(o_lat, w[:, self.nope:].transpose(1, 2)).transpose(0, 1)
