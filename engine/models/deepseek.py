"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``).

The Llama decoder's skeleton (pre-norm layers over a residual stream updated in place, the
embedding, final norm and LM head, tied or not) with two parts of DeepSeek's own:

- attention is multi-head latent attention (``mla.py``): the KV cache holds one latent plane
  per layer (``ModelArch.kv_planes`` 1), prefill up-projects, decode absorbs;
- the MLP of layer ``i`` is DeepSeek's mixture of experts (``deepseek_moe.py``) from
  ``first_k_dense_replace`` on (every ``moe_layer_freq``-th), the dense SwiGLU before.

V2 and V3 differ in their gating (softmax greedy / group-limited vs sigmoid with a selection
bias) and in how the config states its rope layout (V2 always interleaved, V3 by
``rope_interleave``); YaRN where the config scales its rope, with DeepSeek's ``mscale`` on the
softmax scale (``attn_scale``).

What the engine's CPU fast paths do with it: the linears are packed as every model's are; the
fused native decode layers decline it (``FusedDecode.for_model``: an MoE, and a latent cache);
the native paged decode kernel serves the absorbed decode (one KV head of ``kv_lora_rank +
qk_rope_head_dim``); prefill spans attend through torch SDPA (up-projected per head), whatever
the backend; where the backend prunes the last layer to the rows read (the native one, at head
sizes its prefill kernel takes), those rows attend absorbed, as decodes. On CUDA the runner
serves it on torch SDPA (flash-attn does not read a latent).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from kvrelay.engine.attention import AttentionFn, current_metadata
from kvrelay.engine.models.arch import ModelArch, rope_parameters
from kvrelay.engine.models.deepseek_moe import DeepseekMoE
from kvrelay.engine.models.linear import Linear
from kvrelay.engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from kvrelay.engine.models.mla import MLAttention, RopeRows, decode_view, rows_as_decodes
from kvrelay.engine.models.mlp import MLP
from kvrelay.engine.models.moe import SparseMoE
from kvrelay.engine.models.rope import rope_inv_freq
from kvrelay.engine.models.weights import Cuts, WeightTarget, mlp_targets


def attn_scale(arch: ModelArch, hf_cfg: Any) -> float:
    """The softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim)``
    squared under a scaled rope with ``mscale_all_dim`` (DeepSeek's YaRN)."""
    scale = (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_cfg)
    factor, all_dim = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and all_dim and factor > 1:
        m = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


class DeepseekDecoderLayer(DecoderLayer):
    attention_class = MLAttention  # type: ignore[assignment]

    @staticmethod
    def make_mlp(arch: ModelArch, layer: int) -> MLP | SparseMoE:
        return DeepseekMoE(arch) if arch.sparse_layers[layer] else MLP(arch)

    def forward(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,  # type: ignore[override]
                sin: torch.Tensor, meta: Any, decodes: Any,
                next_norm: RMSNorm | None) -> torch.Tensor | None:
        """As Llama's layer: ``x`` is ``input_norm(h)``, returns ``next_norm(h)`` after both
        residual adds into ``h`` (None without a next norm)."""
        x = self.post_attn_norm.add_and_norm(h, self.attn(x, cos, sin, meta, decodes))
        m = self.mlp(x)
        if next_norm is None:
            h.add_(m)
            return None
        return next_norm.add_and_norm(h, m)

    def forward_rows(self, h: torch.Tensor, x: torch.Tensor,  # type: ignore[override]
                     cos: torch.Tensor, sin: torch.Tensor, meta: Any, rows: Any,
                     last: Any) -> torch.Tensor:
        """The last layer for the rows ``last.rows`` alone: their residual stream after it
        (``[R, hidden]``, a new tensor)."""
        hr = h.index_select(0, last.rows)
        x = self.post_attn_norm.add_and_norm(hr, self.attn.forward_rows(x, cos, sin, meta, rows,
                                                                         last))
        hr.add_(self.mlp(x))
        return hr


class DeepseekForCausalLM(LlamaForCausalLM):
    layer_class = DeepseekDecoderLayer

    @classmethod
    def from_config(cls, arch: ModelArch, hf_cfg: Any, attn_fn: AttentionFn,
                    max_positions: int, compute_dtype: torch.dtype) -> DeepseekForCausalLM:
        inv_freq, rope_scale = rope_inv_freq(hf_cfg, arch.qk_rope_head_dim)
        model = cls(arch, attn_fn, inv_freq, rope_scale, max_positions,
                    compute_dtype=compute_dtype)
        model.rotary.to(compute_dtype)
        scale = attn_scale(arch, hf_cfg)
        for layer in model.layers:
            layer.attn.scale = scale
        return model

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        arch = self.arch
        out = {"model.embed_tokens.weight": WeightTarget(self.embed),
               "model.norm.weight": WeightTarget(self.norm.weight)}
        if self.lm_head.weight is not None:
            out["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = WeightTarget(layer.input_norm.weight)
            out[p + "post_attention_layernorm.weight"] = WeightTarget(layer.post_attn_norm.weight)
            out.update(_attention_targets(layer.attn, p + "self_attn.", arch))
            m = layer.mlp
            out.update(m.checkpoint_targets(p + "mlp.") if isinstance(m, DeepseekMoE)
                       else mlp_targets(m, p + "mlp."))
        return out

    def unused_checkpoint_weight(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a layer past the decoder's: DeepSeek-V3's
        multi-token-prediction module (``num_nextn_predict_layers``, stored as layer 61 of 61),
        which greedy decoding does not run (the loader skips it)."""
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
            and int(parts[2]) >= self.arch.num_layers

    def bind_kv_cache(self, kv: torch.Tensor) -> None:
        """Each layer's view of its latent plane, flat ``[slots, 1, kv_lora_rank + rope]``."""
        assert kv.dim() == 6 and kv.shape[1] == 1, "MLA caches one latent plane per layer"
        _, _, nb, bs, heads, width = kv.shape
        for i, layer in enumerate(self.layers):
            layer.attn.cache = kv[i, 0].view(nb * bs, heads, width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        if h.dtype != self.compute_dtype:
            h = h.to(self.compute_dtype)
        meta = current_metadata()
        decodes = decode_view(meta)
        layers = self.layers
        x = layers[0].input_norm.add_and_norm(h, None)
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
        last = meta.last_layer
        rows = None if last is None else rows_as_decodes(last)
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else None
            if nxt is None and rows is not None:
                return layer.forward_rows(h, x, cos, sin, meta, rows, last)
            x = layer(h, x, cos, sin, meta, decodes, nxt)
        # Every row ran the last layer (a backend without the rows' metadata): keep the rows
        # the step reads.
        return h if last is None else h.index_select(0, last.rows)

    def shard_layer_tensor_parallel(self, layer: torch.nn.Module, shard: Any,
                                    cuts: Cuts) -> None:
        """Rank ``shard.rank``'s part of ``layer`` (``tp_shard.shard_layer`` defers to this):
        its query heads (q_b_proj's or q_proj's rows, kv_b_proj's rows, o_proj's columns,
        all-reduced after), the latent projections and the cache replicated (every rank holds
        the whole latent), its feed-forward block cut as every family's (``shard_ffn``);
        ``cuts``: as in ``tp_shard.shard_model``."""
        from kvrelay.engine.tp_shard import _keep, _row_parallel, shard_ffn

        r, n = shard.rank, shard.size
        a = layer.attn
        heads = a.num_heads // n
        qs = slice(r * heads * a.qk_dim, (r + 1) * heads * a.qk_dim)
        if a.q_b is not None:
            a.q_b.weight = _keep(a.q_b.weight, [qs], cuts=cuts)
            a.q_b.out_features = heads * a.qk_dim
        else:  # q_proj's rows of the fused input projection, the latent's all
            lat = slice(a.q_in, a.q_in + a.rank + a.rope_dim)
            a.in_proj.weight = _keep(a.in_proj.weight, [qs, lat], cuts=cuts)
            a.in_proj.bias = _keep(a.in_proj.bias, [qs, lat], cuts=cuts)
            a.q_in = heads * a.qk_dim
            a.in_proj.out_features = a.q_in + a.rank + a.rope_dim
        kv_rows = heads * (a.nope + a.v_dim)
        a.kv_b = _keep(a.kv_b, [slice(r * kv_rows, (r + 1) * kv_rows)], cuts=cuts)
        a.o.weight = _keep(a.o.weight, [slice(r * heads * a.v_dim,
                                              (r + 1) * heads * a.v_dim)], dim=1, cuts=cuts)
        if r != 0:
            a.o.bias = None
        _row_parallel(a.o, shard)
        a.num_heads = heads
        shard_ffn(layer.mlp, shard, cuts)


def _attention_targets(a: MLAttention, p: str, arch: ModelArch) -> dict[str, WeightTarget]:
    """One layer's attention tensors: q_a_proj (or q_proj) and kv_a_proj_with_mqa into the
    fused input projection, the rope rows de-interleaved where the checkpoint interleaves
    them."""
    h, rank, rope = arch.num_heads, a.rank, a.rope_dim

    def rows(param: torch.Tensor, start: int, stop: int, groups: int, group_rows: int,
             at: int) -> WeightTarget:
        if not arch.rope_interleave:
            return WeightTarget(param, start, stop)
        return RopeRows(param, start, stop, groups=groups, group_rows=group_rows, at=at,
                        width=rope)

    q_in = a.q_in
    out: dict[str, WeightTarget] = {}
    kv_a = p + "kv_a_proj_with_mqa."
    lin: Linear = a.in_proj
    out[kv_a + "weight"] = rows(lin.weight, q_in, q_in + rank + rope, 1, rank + rope, rank)
    if lin.bias is not None:
        out[kv_a + "bias"] = rows(lin.bias, q_in, q_in + rank + rope, 1, rank + rope, rank)
    if a.q_b is not None:
        out[p + "q_a_proj.weight"] = WeightTarget(lin.weight, 0, q_in)
        if lin.bias is not None:
            out[p + "q_a_proj.bias"] = WeightTarget(lin.bias, 0, q_in)
        out[p + "q_a_layernorm.weight"] = WeightTarget(a.q_norm.weight)
        out[p + "q_b_proj.weight"] = rows(a.q_b.weight, None, None, h, a.qk_dim, a.nope)
    else:
        out[p + "q_proj.weight"] = rows(lin.weight, 0, q_in, h, a.qk_dim, a.nope)
    out[p + "kv_a_layernorm.weight"] = WeightTarget(a.kv_norm.weight)
    out[p + "kv_b_proj.weight"] = WeightTarget(a.kv_b)
    out[p + "o_proj.weight"] = WeightTarget(a.o.weight)
    if a.o.bias is not None:
        out[p + "o_proj.bias"] = WeightTarget(a.o.bias)
    return out
