"""A pure-torch stand-in for flash-attn 2's ``flash_attn_varlen_func``, for the GPU smoke.

The first GPU machine kvrelay meets may have no flash-attn (no wheel for its torch, no compiler
time, no network). The engine's flash path (paged cache read through ``block_table``, CUDA
graphs around it) is the path GPU users run, so the smoke puts this package first on
``PYTHONPATH`` under flash-attn's own name and the engine takes it for the real thing.

It computes what flash-attn's kernel computes, from the same arguments:
- varlen batches described by ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32 prefix sums);
- K/V either packed like Q or, with ``block_table``, read from a paged cache
  ``[num_blocks, block_size, kv_heads, head_dim]`` through each sequence's block table;
- grouped-query attention (query heads a multiple of KV heads);
- the causal mask aligned bottom-right (a chunk over a cached prefix sees the whole prefix),
  and ``window_size=(left, right)`` with -1 meaning unbounded.

Graph-safe: every shape comes from the tensors' shapes and the two ``max_seqlen_*`` ints, no
value is read back to the host, so it can be captured inside a CUDA graph. It pads every
sequence to ``max_seqlen_q`` x ``max_seqlen_k`` and so costs far more memory and time than the
real kernel: numbers measured through it say nothing about flash-attn's speed.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+kvrelay-standin"
STANDIN = True


def _rows(cu: torch.Tensor, width: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sequence b and offset i < width: the packed row cu[b] + i (clamped into range)
    and whether it belongs to b."""
    start, lens = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
    offs = torch.arange(width, device=cu.device)
    return (start[:, None] + offs).clamp(max=max(total - 1, 0)), offs < lens[:, None]


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
    return_attn_probs: bool = False, block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    assert dropout_p == 0.0 and alibi_slopes is None and not return_attn_probs
    total_q, heads, dim = q.shape
    scale = softmax_scale if softmax_scale is not None else dim ** -0.5
    nseq = cu_seqlens_q.shape[0] - 1
    q_idx, q_ok = _rows(cu_seqlens_q, max_seqlen_q, total_q)
    qp = q[q_idx]  # [B, Mq, H, D]
    if block_table is None:
        k_idx, k_ok = _rows(cu_seqlens_k, max_seqlen_k, k.shape[0])
        kp, vp = k[k_idx], v[k_idx]
    else:
        bs = k.shape[1]
        pos = torch.arange(max_seqlen_k, device=q.device)
        col = (pos // bs).clamp(max=block_table.shape[1] - 1)
        blocks = block_table[:, col].long()  # [B, Mk]
        kp, vp = k[blocks, pos % bs], v[blocks, pos % bs]  # [B, Mk, KVH, D]
        k_ok = pos[None, :] < (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()[:, None]
    group = heads // kp.shape[2]
    if group > 1:
        kp, vp = kp.repeat_interleave(group, dim=2), vp.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qp.float(), kp.float()) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()[:, None, None]
    len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()[:, None, None]
    qi = torch.arange(max_seqlen_q, device=q.device)[None, :, None]
    kj = torch.arange(max_seqlen_k, device=q.device)[None, None, :]
    at = len_k - len_q + qi  # the query's position among the keys (bottom-right aligned)
    ok = k_ok[:, None, :] & q_ok[:, :, None]
    left, right = window_size
    if causal:
        right = 0
    if right >= 0:
        ok = ok & (kj <= at + right)
    if left >= 0:
        ok = ok & (kj >= at - left)
    scores = scores.masked_fill(~ok[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padding rows see no key
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vp.float()).to(q.dtype)  # [B, Mq, H, D]
    # back to packed rows: row r belongs to the sequence whose span holds it
    r = torch.arange(total_q, device=q.device)
    b = torch.searchsorted(cu_seqlens_q[1:].long(), r, right=True).clamp(max=max(nseq - 1, 0))
    return out[b, r - cu_seqlens_q[:-1].long()[b]]
