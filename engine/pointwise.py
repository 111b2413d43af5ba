"""The per-token ops between a decoder layer's matmuls: the residual add fused with the next
RMSNorm, rotate-half RoPE, SwiGLU's silu(gate) x up and the scatter of the step's K/V rows into
the paged caches, each one native call (``engine/cpu/csrc/pointwise.c``) on CPU fp32.

At decode-sized steps these ops are microseconds of arithmetic behind many torch dispatches
(``F.rms_norm`` is ~6 ops, the RoPE ~8 per tensor): on the ~150M demo model they were ~15% of a
batch-8 decode step, and far more of a step of the ~7M model, whose matmuls are tiny. Elsewhere
(GPU, other dtypes, no compiler) the same functions run the torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.engine.cpu import native

_F32 = torch.float32


def _native(*ts: torch.Tensor) -> bool:
    # native.load() is memoized but takes a lock; this runs ~50 times a step
    return all(t.dtype is _F32 and t.device.type == "cpu" for t in ts) and native.load() is not None


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``h += delta`` in place (when given), then return ``rms_norm(h) * weight`` as a new
    tensor. ``h`` ``[T, D]`` must be contiguous (it is the residual stream)."""
    if _native(h, weight) and (delta is None or _native(delta)) and h.is_contiguous():
        if delta is not None and not delta.is_contiguous():
            delta = delta.contiguous()
        out = torch.empty_like(h)
        native.load().kvr_add_rmsnorm_f32(
            h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
            out.data_ptr(), h.shape[0], h.shape[1], eps, torch.get_num_threads())
        return out
    if delta is not None:
        h.add_(delta)
    return F.rms_norm(h, weight.shape, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[T, H, D]`` (rows may be strided, heads contiguous within a
    row: a view into the fused qkv output) with ``cos``/``sin`` ``[T, D/2]``; a new contiguous
    ``[T, H, D]``."""
    t, h, d = x.shape
    if _native(x, cos, sin) and x.stride(2) == 1 and x.stride(1) == d \
            and cos.is_contiguous() and sin.is_contiguous():
        out = x.new_empty(t, h, d)
        native.load().kvr_rope_f32(x.data_ptr(), x.stride(0), out.data_ptr(), t, h, d,
                                   cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
        return out
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    half = d // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gu[:, :inter]) * gu[:, inter:]`` for the fused gate/up output ``gu``
    ``[T, 2 * inter]`` (rows may be strided, each row contiguous); a new ``[T, inter]``."""
    if _native(gu) and gu.stride(1) == 1 and gu.shape[1] == 2 * inter:
        out = gu.new_empty(gu.shape[0], inter)
        native.load().kvr_silu_mul_f32(gu.data_ptr(), gu.stride(0), out.data_ptr(),
                                       gu.shape[0], inter, torch.get_num_threads())
        return out
    gate, up = gu.split(inter, dim=-1)
    return F.silu(gate).mul_(up)


def _rows(t: torch.Tensor) -> bool:
    """Rows of ``[T, heads, hd]`` whose heads lie contiguous (a row's floats in one run)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def write_kv_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, slots: torch.Tensor) -> None:
    """``k_cache[slots[i]] = k[i]`` and the same for V, for ``i < len(slots)``: flat caches
    ``[slots, kv_heads, hd]``, ``k``/``v`` ``[T, kv_heads, hd]`` (rows may be strided views into
    the fused qkv output)."""
    n = slots.shape[0]
    bf16 = k_cache.dtype is torch.bfloat16 and v_cache.dtype is torch.bfloat16 \
        and k_cache.device.type == "cpu"
    if (bf16 or _native(k_cache, v_cache)) and _native(k, v) and slots.dtype is torch.int64 \
            and slots.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() \
            and _rows(k) and _rows(v):  # _native(k, v): the library is here
        row = k.shape[1] * k.shape[2]
        lib = native.load()
        # Into a bf16 cache each value is rounded to nearest even, the bits torch's store gives.
        write = lib.kvr_write_kv_bf16 if bf16 else lib.kvr_write_kv_f32
        rc = write(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), n,
            k_cache.data_ptr(), v_cache.data_ptr(), row, torch.get_num_threads())
        if rc != 0:
            raise ValueError("negative slot in the slot mapping")
        return
    # A cache of another dtype (bf16 KV under fp32 activations) gets each value rounded to
    # nearest even, as every path that stores into it does.
    k_cache.index_copy_(0, slots, k[:n].to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v[:n].to(v_cache.dtype))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x`` ``[N, V]`` (int64, the same index: the first largest, a
    NaN the largest), natively where ``x`` is contiguous CPU fp32 with ``V > 0``."""
    if x.dim() == 2 and x.shape[1] > 0 and _native(x) and x.is_contiguous():
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if native.load().kvr_argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1],
                                             out.data_ptr(), torch.get_num_threads()) == 0:
            return out
    return x.argmax(dim=-1)
