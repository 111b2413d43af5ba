"""The Llama decoder family (Llama 2/3, Mistral, Qwen2, Qwen3) on the paged KV cache.

Tokens of a step arrive flattened (``[T]``), so one matmul serves every sequence in the batch.
q/k/v and gate/up projections are fused into single weights at load time. Logits are computed
only for the rows that sample.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.attention import AttentionFn, current_metadata, write_kv
from kvrelay.engine.models.arch import ModelArch


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def onednn_packing_available() -> bool:
    """Whether this torch build can prepack fp32 linear weights for oneDNN (x86 CPU builds)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4), None)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y, torch.full((2, 4), 4.0)))


class Linear(nn.Module):
    """``y = x W^T + b``. On CPU in fp32 the weight is prepacked once into oneDNN's blocked
    layout: a plain GEMM repacks the weight on every call, which at decode-sized batches
    (a few rows) costs 2-3x the matmul itself.

    One row (a batch-1 decode step) is a matrix-vector product whose cost is reading the
    weight once, and there oneDNN's kernel streams the weight at only ~60-70% of the copy
    bandwidth (x86, fp32; measured in bench/engine.py). A row instead goes through a dense
    ``[in, out]`` copy cut along ``in`` into one slab per intra-op thread: one ``bmm`` whose
    batch entries the threads take one each (each a contiguous stream), then a sum of the
    partial rows; with one thread, a plain ``mm``. That reads at ~90% of the copy bandwidth
    with two threads and ~100% with one, for the price of a second copy of the weights
    (``gemv=True`` in :meth:`pack`; off with ``ModelConfig.gemv_weights=False``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight: nn.Parameter | None = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.packed: torch.Tensor | None = None
        self.slabs: torch.Tensor | None = None  # [slabs, in / slabs, out]

    def pack(self, weight: torch.Tensor | None = None, *, gemv: bool = False) -> None:
        """Prepack (``weight`` defaults to this layer's own) and drop the dense parameter; with
        ``gemv`` also keep the transposed slabs for single-row inputs."""
        w = self.weight if weight is None else weight
        assert w is not None
        w = w.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.slabs = gemv_slabs(w) if gemv else None
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.slabs is not None and x.shape[0] == 1:
            s, k, _ = self.slabs.shape
            if s == 1:
                y = torch.mm(x, self.slabs[0])
            else:  # slab i times the row's i-th stretch of inputs, one thread each; then sum
                y = torch.bmm(x.reshape(s, 1, k), self.slabs).sum(0)
            return y if self.bias is None else y.add_(self.bias)
        return self.packed_forward(x)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Through oneDNN's prepacked weight, whatever the row count."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def gemv_slabs(w: torch.Tensor) -> torch.Tensor:
    """``w`` ([out, in]) as a contiguous ``[in, out]`` copy viewed as one slab of input rows
    per intra-op thread (one slab when the threads do not divide ``in``)."""
    threads = torch.get_num_threads()
    s = threads if w.shape[1] % threads == 0 else 1
    return w.t().contiguous().view(s, w.shape[1] // s, w.shape[0])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotate-half RoPE from precomputed cos/sin tables (half width: the two halves share)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, max_positions: int):
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, attn_fn: AttentionFn):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias)
        self.o = Linear(self.q_size, arch.hidden_size, arch.o_bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.window = arch.layer_windows[layer]
        self.scale = arch.head_dim ** -0.5
        self.attn_fn = attn_fn
        self.k_cache: torch.Tensor | None = None  # flat [slots, kv_heads, head_dim] views
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: Rotary) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        meta = current_metadata()
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        if meta.on_kv_written is not None:
            meta.on_kv_written(self.layer)
        o = self.attn_fn(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window)
        return self.o(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU. On CPU, many rows (a long prefill chunk) go through in row chunks sized so one
    chunk's gate/up activations fit in ~16 MiB: they are then still in the last-level cache for
    silu x up and the down projection, instead of making a round trip through memory (measured
    +10-15% on the MLP of a 2048-token prefill, ~150M model, fp32)."""

    CACHE_BYTES = 16 * 2**20

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.inter = arch.intermediate_size
        self.gate_up = Linear(arch.hidden_size, 2 * arch.intermediate_size, arch.mlp_bias)
        self.down = Linear(arch.intermediate_size, arch.hidden_size, arch.mlp_bias)
        rows = self.CACHE_BYTES // (2 * arch.intermediate_size * 4)
        self.chunk_rows = max(64, 1 << max(0, rows.bit_length() - 1))  # a power of two

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate).mul_(up))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[0], self.chunk_rows
        if n <= c or x.device.type != "cpu":
            return self._swiglu(x)
        out = x.new_empty(n, x.shape[1])
        for start in range(0, n, c):
            out[start:start + c] = self._swiglu(x[start:start + c])
        return out


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, attn_fn: AttentionFn):
        super().__init__()
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = Attention(arch, layer, attn_fn)
        self.post_attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: Rotary) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), cos, sin, rotary)
        return h + self.mlp(self.post_attn_norm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, attn_fn: AttentionFn, inv_freq: torch.Tensor,
                 rope_scale: float, max_positions: int):
        super().__init__()
        self.arch = arch
        self.embed = _param(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, attn_fn)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = None  # shares the embedding (see weights())
        self.rotary = Rotary(inv_freq, rope_scale, max_positions)

    def pack_weights(self, *, gemv: bool = False) -> None:
        """Prepack every linear for oneDNN (CPU, fp32), after the weights are loaded; ``gemv``
        keeps the dense weights for single-row steps too (see :class:`Linear`)."""
        for m in self.modules():
            if isinstance(m, Linear) and m is not self.lm_head:
                m.pack(gemv=gemv)
        self.lm_head.pack(self.embed if self.arch.tie_word_embeddings else None, gemv=gemv)

    def _linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    @property
    def has_gemv_slabs(self) -> bool:
        return any(m.slabs is not None for m in self._linears())

    def drop_gemv_slabs(self) -> None:
        for m in self._linears():
            m.slabs = None

    @torch.inference_mode()
    def time_single_row(self, reps: int = 5) -> tuple[float, float]:
        """Seconds of one batch-1 pass over every packed linear (weights streamed from memory,
        as in a decode step) through the dense slabs and through oneDNN: the best of ``reps``
        each, interleaved so both see the same machine. Which is faster depends on the CPU
        (measured 1.3x either way on two x86 machines)."""
        rows = [(m, torch.randn(1, m.slabs.shape[0] * m.slabs.shape[1])) for m in self._linears()
                if m.packed is not None and m.slabs is not None]

        def run(slabs: bool) -> float:
            t = time.perf_counter()
            for m, x in rows:
                if slabs:
                    m(x)
                else:
                    m.packed_forward(x)
            return time.perf_counter() - t

        best = [float("inf"), float("inf")]
        for _ in range(reps):
            for i, slabs in enumerate((True, False)):
                best[i] = min(best[i], run(slabs))
        return best[0], best[1]

    def bind_kv_cache(self, kv: torch.Tensor) -> None:
        """Give each layer flat views of its K and V planes of the engine's one KV tensor."""
        for i, layer in enumerate(self.layers):
            _, _, nb, bs, kvh, hd = kv.shape
            layer.attn.k_cache = kv[i, 0].view(nb * bs, kvh, hd)
            layer.attn.v_cache = kv[i, 1].view(nb * bs, kvh, hd)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        cos = self.rotary.cos[positions].unsqueeze(1)  # [T, 1, head_dim / 2]
        sin = self.rotary.sin[positions].unsqueeze(1)
        for layer in self.layers:
            h = layer(h, cos, sin, self.rotary)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the rows that sample: ``[N, hidden] -> [N, vocab]``."""
        h = self.norm(hidden)
        if self.lm_head.packed is None and self.lm_head.weight is None:  # tied, unpacked
            return F.linear(h, self.embed)
        return self.lm_head(h)
