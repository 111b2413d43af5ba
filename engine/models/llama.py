"""The Llama decoder family (Llama 2/3, Mistral, Qwen2, Qwen3, and with a mixture of experts in
place of the MLP Mixtral, Qwen3-MoE and Qwen2-MoE: ``moe.py``) on the paged KV cache.

Tokens of a step arrive flattened (``[T]``), so one matmul serves every sequence in the batch.
q/k/v and gate/up projections are fused into single weights at load time. Logits are computed
only for the rows that sample, and the last layer runs past its K/V projection only for the rows
that are read (``AttentionMetadata.last_layer``).

The model knows no kernels: its attention function is the backend's, and the platform packs its
linears at load and may give it a fused path for the steps it can run whole
(:mod:`kvrelay.engine.platform`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.attention import (
    AttentionFn,
    AttentionMetadata,
    LastLayerRows,
    current_metadata,
    write_kv,
)
from kvrelay.engine.kv_cache import kv_groups_of, plane_view
from kvrelay.engine.models.arch import ModelArch
from kvrelay.engine.models.linear import Linear, empty_param
from kvrelay.engine.models.mlp import MLP
from kvrelay.engine.models.moe import SparseMoE
from kvrelay.engine.models.rope import rope_inv_freq
from kvrelay.engine.models.weights import MIXTRAL_EXPERT_NAMES, WeightTarget, mlp_targets
from kvrelay.engine.pointwise import add_rms_norm, rope


class FusedPath(Protocol):
    """A platform's path through every layer at once, for the steps it takes (the CPU's fused
    decode layers, :mod:`kvrelay.engine.cpu.fused_decode`)."""

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Every layer over ``h`` in place, or False (nothing done) for a step it does not
        take."""

    def normed(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The final norm of ``hidden`` where the last :meth:`run` computed it, else None."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """``h += delta`` in place, then this norm of ``h`` (one native pass on CPU fp32)."""
        return add_rms_norm(h, delta, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotate-half RoPE from precomputed cos/sin tables (half width: the two halves share)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, max_positions: int):
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H, D]`` (a strided view is fine), ``cos``/``sin`` ``[T, D/2]``."""
        return rope(x, cos, sin)


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
        self.k_cache: torch.Tensor | None = None  # kv_cache.plane_view of each plane
        self.v_cache: torch.Tensor | None = None
        # Under KV head groups, every group's (K, V) views (k_cache/v_cache: group 0's).
        self.kv_groups: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Under the hybrid KV layout (engine/hybrid_kv.py): this layer's layer group, whose
        # metadata (``AttentionMetadata.groups``) addresses its pages.
        self.kv_group = 0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: Rotary) -> torch.Tensor:
        q, k, v = self._project(x, cos, sin, rotary, None)
        return self._attend(q, k, v, self._step_meta(), None)

    def forward_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rotary: Rotary, last: LastLayerRows) -> torch.Tensor:
        """:meth:`forward` for the rows ``last.rows`` only (``[R, hidden]``): K/V of every row
        still go to the cache; only those rows' queries attend and reach the output projection.
        ``cos``/``sin`` are every row's."""
        q, k, v = self._project(x, cos, sin, rotary, last.rows)
        return self._attend(q, k, v, self._step_meta(), last.meta)

    def _step_meta(self) -> AttentionMetadata:
        """The step's metadata as this layer reads it (its layer group's, under the hybrid KV
        layout)."""
        meta = current_metadata()
        return meta if meta.groups is None else meta.groups[self.kv_group]

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Rotary,
                 rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (of ``rows`` only, where given), k and v of every row, normed and rotated."""
        t = x.shape[0]
        q, k, v = self.qkv(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        qcos, qsin = cos, sin
        if rows is not None:
            q, qcos, qsin = (a.index_select(0, rows) for a in (q, cos, sin))
        q = q.view(q.shape[0], self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotary(q, qcos, qsin), rotary(k, cos, sin), v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, queries: AttentionMetadata | None) -> torch.Tensor:
        """Every row's K/V into the cache, then ``q``'s rows attend (laid out as ``queries``
        says; the step's ``meta`` by default) and go through the output projection. Under KV
        head groups each group's K/V go to its own tensor and its query heads attend over it."""
        queries = meta if queries is None else queries
        if len(self.kv_groups) <= 1:
            write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
            if meta.on_kv_written is not None:
                meta.on_kv_written(self.layer)
            o = self._attention(q, k, v, self.k_cache, self.v_cache, queries,
                                slice(0, self.num_heads))
            return self.o(o.reshape(q.shape[0], self.q_size))
        n = len(self.kv_groups)
        hq, hk = self.num_heads // n, self.num_kv_heads // n
        for g, (kc, vc) in enumerate(self.kv_groups):
            write_kv(kc, vc, k[:, g * hk:(g + 1) * hk], v[:, g * hk:(g + 1) * hk],
                     meta.slot_mapping)
        if meta.on_kv_written is not None:
            meta.on_kv_written(self.layer)
        out = torch.empty_like(q)
        for g, (kc, vc) in enumerate(self.kv_groups):
            qs, ks = slice(g * hq, (g + 1) * hq), slice(g * hk, (g + 1) * hk)
            out[:, qs] = self._attention(q[:, qs].contiguous(), k[:, ks].contiguous(),
                                         v[:, ks].contiguous(), kc, vc, queries, qs)
        return self.o(out.reshape(q.shape[0], self.q_size))

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   heads: slice) -> torch.Tensor:
        """The backend's attention of the query heads ``heads`` of this layer (all of them, or
        one KV head group's): what a family with more to it (gpt-oss's sinks) overrides."""
        return self.attn_fn(q, k, v, k_cache, v_cache, meta, self.scale, self.window)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer over a residual stream ``h`` that it updates in place: each residual
    add is fused with the RMSNorm that follows it (:func:`add_rms_norm`), this layer's
    post-attention norm and the next layer's input norm (or none after the last layer)."""

    def __init__(self, arch: ModelArch, layer: int, attn_fn: AttentionFn):
        super().__init__()
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = self.attention_class(arch, layer, attn_fn)
        self.post_attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: MLP | SparseMoE = self.make_mlp(arch, layer)

    attention_class: type[Attention] = Attention  # a family's own attention subclasses it

    @staticmethod
    def make_mlp(arch: ModelArch, layer: int) -> MLP | SparseMoE:
        """Layer ``layer``'s MLP: the dense SwiGLU or, in a sparse layer, the experts."""
        return SparseMoE(arch) if arch.sparse_layers[layer] else MLP(arch)

    def forward(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: Rotary, next_norm: RMSNorm | None) -> torch.Tensor | None:
        """``x`` is ``input_norm(h)``; returns ``next_norm(h)`` after this layer's two residual
        adds into ``h`` (None without a next norm)."""
        x = self.post_attn_norm.add_and_norm(h, self.attn(x, cos, sin, rotary))
        m = self.mlp(x)
        if next_norm is None:
            h.add_(m)
            return None
        return next_norm.add_and_norm(h, m)

    def forward_rows(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, rotary: Rotary, last: LastLayerRows) -> torch.Tensor:
        """The last layer for the rows ``last.rows`` alone: returns their residual stream after
        it (``[R, hidden]``, a new tensor: ``h`` is not updated)."""
        hr = h.index_select(0, last.rows)
        x = self.post_attn_norm.add_and_norm(hr, self.attn.forward_rows(x, cos, sin, rotary,
                                                                         last))
        hr.add_(self.mlp(x))
        return hr


class LlamaForCausalLM(nn.Module):
    """The model over weights of the default dtype at construction (the checkpoint's) and
    activations of ``compute_dtype`` (default: the same): the residual stream, q/k/v, attention
    and logits are ``compute_dtype``, and so are the norm weights; the embedding rows are
    widened as they are gathered and the linears take ``compute_dtype`` in and out (on CPU bf16
    weights under fp32 activations: their kernels widen the weights in registers)."""

    layer_class: type[DecoderLayer] = DecoderLayer  # a family's own layers subclass it

    def __init__(self, arch: ModelArch, attn_fn: AttentionFn, inv_freq: torch.Tensor,
                 rope_scale: float, max_positions: int,
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.arch = arch
        self.compute_dtype = compute_dtype or torch.get_default_dtype()
        self.embed = empty_param(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(arch, i, attn_fn)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = None  # shares the embedding (see weights())
        self.rotary = Rotary(inv_freq, rope_scale, max_positions)
        self.fused_decode: FusedPath | None = None  # the platform's, set at load
        for m in self.modules():  # a norm's weight scales activations: it is one of them
            if isinstance(m, RMSNorm) and m.weight.dtype != self.compute_dtype:
                m.weight = nn.Parameter(m.weight.to(self.compute_dtype), requires_grad=False)

    @classmethod
    def from_config(cls, arch: ModelArch, hf_cfg: Any, attn_fn: AttentionFn,
                    max_positions: int, compute_dtype: torch.dtype) -> LlamaForCausalLM:
        """The model of a checkpoint's config, on the current default device and dtype (the
        weights'), its rope tables in ``compute_dtype``."""
        inv_freq, rope_scale = rope_inv_freq(hf_cfg, arch.head_dim)
        model = cls(arch, attn_fn, inv_freq, rope_scale, max_positions,
                    compute_dtype=compute_dtype)
        model.rotary.to(compute_dtype)
        return model

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        """Each checkpoint tensor's place in this model, by the names its checkpoints use."""
        arch = self.arch
        out = {"model.embed_tokens.weight": WeightTarget(self.embed),
               "model.norm.weight": WeightTarget(self.norm.weight)}
        if self.lm_head.weight is not None:
            out["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = layer.attn, layer.mlp
            out[p + "input_layernorm.weight"] = WeightTarget(layer.input_norm.weight)
            out[p + "post_attention_layernorm.weight"] = WeightTarget(layer.post_attn_norm.weight)
            for kind, fused in (("weight", a.qkv.weight), ("bias", a.qkv.bias)):
                if fused is not None:
                    out[p + f"self_attn.q_proj.{kind}"] = WeightTarget(fused, 0, q)
                    out[p + f"self_attn.k_proj.{kind}"] = WeightTarget(fused, q, q + kv)
                    out[p + f"self_attn.v_proj.{kind}"] = WeightTarget(fused, q + kv, q + 2 * kv)
            out[p + "self_attn.o_proj.weight"] = WeightTarget(a.o.weight)
            if a.o.bias is not None:
                out[p + "self_attn.o_proj.bias"] = WeightTarget(a.o.bias)
            if a.q_norm is not None:
                out[p + "self_attn.q_norm.weight"] = WeightTarget(a.q_norm.weight)
                out[p + "self_attn.k_norm.weight"] = WeightTarget(a.k_norm.weight)
            if isinstance(m, SparseMoE):
                out.update(_moe_targets(m, p, arch))
            else:
                out.update(mlp_targets(m, p + "mlp."))
        return out

    def bind_kv_cache(self, kv: torch.Tensor, heads_first: bool = False) -> None:
        """Give each layer views of its K and V planes of the engine's KV tensor (of every head
        group's, under KV head groups): flat slot rows, or blocks when ``heads_first``
        (``kv_cache.plane_view``)."""
        groups = kv_groups_of(kv)
        for i, layer in enumerate(self.layers):
            views = [(plane_view(g[i, 0], heads_first), plane_view(g[i, 1], heads_first))
                     for g in groups]
            layer.attn.k_cache, layer.attn.v_cache = views[0]
            layer.attn.kv_groups = views

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        if h.dtype != self.compute_dtype:
            h = h.to(self.compute_dtype)
        layers = self.layers
        meta = current_metadata()
        last = meta.last_layer
        if self.fused_decode is not None and self.fused_decode.run(h, positions, meta):
            return h if last is None else h.index_select(0, last.rows)
        x = layers[0].input_norm.add_and_norm(h, None)
        cos = self.rotary.cos[positions]  # [T, head_dim / 2]
        sin = self.rotary.sin[positions]
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else None
            if nxt is None and last is not None:
                return layer.forward_rows(h, x, cos, sin, self.rotary, last)
            x = layer(h, x, cos, sin, self.rotary, nxt)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the rows that sample: ``[N, hidden] -> [N, vocab]``.
        (The norm runs natively: right after the decode layers, torch's took ~0.15 ms.)"""
        fd = self.fused_decode  # whose last layer may have computed the norm already
        h = fd.normed(hidden) if fd is not None else None
        h = self.norm.add_and_norm(hidden.contiguous(), None) if h is None else h
        lm = self.lm_head
        if lm.weight is None and not lm.is_packed:  # tied, unpacked
            # Widened for the call, not h rounded (as Linear does): a CPU without the native
            # GEMM is the only place this runs with two dtypes.
            return F.linear(h, self.embed.to(h.dtype))
        return self.lm_head(h)


def _moe_targets(moe: SparseMoE, layer_prefix: str, arch: ModelArch) -> dict[str, WeightTarget]:
    """A sparse layer's router and experts, by the names their checkpoints use on the Hub (and
    transformers' ``save_pretrained`` writes): Mixtral's ``block_sparse_moe.gate`` and
    ``experts.N.w1/w3/w2``, the Qwen MoEs' ``mlp.gate`` and ``experts.N.gate_proj/up_proj/
    down_proj`` (and Qwen2-MoE's ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``)."""
    if arch.family == "mixtral":
        return moe.checkpoint_targets(layer_prefix + "block_sparse_moe.",
                                      expert_names=MIXTRAL_EXPERT_NAMES)
    return moe.checkpoint_targets(layer_prefix + "mlp.")
