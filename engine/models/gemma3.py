"""Gemma 3's text decoder (``Gemma3ForCausalLM``) on the paged KV cache.

It is the Llama decoder with Gemma's conventions, so it reuses the Llama pieces (the fused
q/k/v ``Attention``, the row-pruned last layer, the MLP's fused gate/up) and changes only what
differs:

- the embedding rows are scaled by ``sqrt(hidden_size)`` (in the compute dtype);
- every RMSNorm multiplies by ``1 + w`` (the checkpoint stores ``w``, zero at init) and runs in
  fp32 whatever the activations' dtype;
- a "sandwich" of four norms per layer: the attention output and the MLP output are each
  normed before they join the residual stream (``post_attention`` / ``post_feedforward``), and
  the MLP's input has a norm of its own (``pre_feedforward``);
- the MLP is GeGLU (``gelu_pytorch_tanh`` of the gate);
- queries and keys are RMS-normed per head, and scores scale by ``query_pre_attn_scalar**-0.5``;
- layers alternate sliding-window (local) and full (global) attention by ``layer_types``, and
  each kind has its own rope table: local layers ``rope_local_base_freq`` unscaled, global
  layers the global base with its scaling (transformers 5 keeps both in ``rope_parameters``,
  keyed by layer type);
- the logits may be soft-capped (``final_logit_softcapping``). Attention logit soft-capping
  (Gemma 2's) is refused at config time: no attention backend here applies it.

Layers keep the Llama attribute names (``attn`` with ``qkv``/``o``, ``mlp`` with
``gate_up``/``down``), so tensor parallelism (``tp_shard.shard_model``) and the platform's
linear packing treat this model as they treat Llama. The CPU's fused decode layers decline it
(they know neither q/k norms nor the sandwich norms): it runs op by op.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.attention import AttentionFn, LastLayerRows, current_metadata
from kvrelay.engine.kv_cache import kv_groups_of, plane_view
from kvrelay.engine.models.arch import ModelArch, UnsupportedModelError
from kvrelay.engine.models.linear import Linear, empty_param
from kvrelay.engine.models.llama import Attention, FusedPath, Rotary
from kvrelay.engine.models.mlp import MLP
from kvrelay.engine.models.weights import WeightTarget, mlp_targets
from kvrelay.engine.pointwise import add_rms_norm

LOCAL, GLOBAL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """``rms_norm(x) * (1 + w)``, computed in fp32 and returned in ``x``'s dtype (as Gemma's
    reference does: in a bf16 model the norm itself is still fp32). Rows of fp32 activations
    take the native pass (:func:`add_rms_norm`, with a residual add fused where there is one)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            return add_rms_norm(x, None, 1.0 + self.weight.float(), self.eps)
        return self._fp32(x)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``h += delta`` in place, then this norm of ``h``."""
        if h.dtype == torch.float32 and h.is_contiguous():
            return add_rms_norm(h, delta, 1.0 + self.weight.float(), self.eps)
        h.add_(delta)
        return self._fp32(h)

    def _fp32(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())
        return y.to(x.dtype)


class GeGLU(MLP):
    """Gemma's MLP: ``down(gelu_tanh(gate) * up)``, gate and up fused as in the SwiGLU (the
    platform's row chunking and tensor parallelism's sharding apply unchanged)."""

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(Attention):
    """Llama's attention with Gemma's per-head q/k norms (``1 + w``) and score scale."""

    def __init__(self, arch: ModelArch, layer: int, attn_fn: AttentionFn):
        super().__init__(arch, layer, attn_fn)
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.scale = float(arch.query_pre_attn_scalar or arch.head_dim) ** -0.5


class Gemma3DecoderLayer(nn.Module):
    """One layer over the residual stream ``h`` (updated in place): attention and MLP each
    between an input norm and an output norm. Each residual add is fused with the norm that
    reads ``h`` next: this layer's ``pre_ff_norm``, then the next layer's ``input_norm``."""

    def __init__(self, arch: ModelArch, layer: int, attn_fn: AttentionFn):
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_norm = GemmaRMSNorm(arch.hidden_size, eps)
        self.attn = Gemma3Attention(arch, layer, attn_fn)
        self.post_attn_norm = GemmaRMSNorm(arch.hidden_size, eps)
        self.pre_ff_norm = GemmaRMSNorm(arch.hidden_size, eps)
        self.mlp = GeGLU(arch, bias=False)
        self.post_ff_norm = GemmaRMSNorm(arch.hidden_size, eps)
        self.is_local = arch.layer_windows[layer] is not None

    def forward(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rotary: Rotary, next_norm: GemmaRMSNorm | None) -> torch.Tensor | None:
        """``x`` is ``input_norm(h)``; returns ``next_norm(h)`` after this layer's two residual
        adds into ``h`` (None without a next norm)."""
        x = self.pre_ff_norm.add_and_norm(h, self.post_attn_norm(self.attn(x, cos, sin, rotary)))
        m = self.post_ff_norm(self.mlp(x))
        if next_norm is None:
            h.add_(m)
            return None
        return next_norm.add_and_norm(h, m)

    def forward_rows(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, rotary: Rotary, last: LastLayerRows) -> torch.Tensor:
        """This layer for the rows ``last.rows`` alone (every row's K/V still written):
        their residual stream after it, ``[R, hidden]`` (a new tensor)."""
        hr = h.index_select(0, last.rows)
        a = self.post_attn_norm(self.attn.forward_rows(x, cos, sin, rotary, last))
        hr.add_(self.post_ff_norm(self.mlp(self.pre_ff_norm.add_and_norm(hr, a))))
        return hr


class Gemma3ForCausalLM(nn.Module):
    """The model over weights of the default dtype at construction and activations of
    ``compute_dtype`` (norm weights too), as ``LlamaForCausalLM``. ``rotary`` is the global
    layers' table and ``rotary_local`` the local layers'."""

    def __init__(self, arch: ModelArch, attn_fn: AttentionFn,
                 ropes: dict[str, tuple[torch.Tensor, float]], max_positions: int,
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.arch = arch
        self.compute_dtype = compute_dtype or torch.get_default_dtype()
        self.embed = empty_param(arch.vocab_size, arch.hidden_size)
        # sqrt(hidden) rounded to the compute dtype, as the reference rounds it to the weights'
        # (a Python float: no tensor made per call, nothing for a CUDA graph to capture)
        self.embed_scale = float(torch.tensor(math.sqrt(arch.hidden_size),
                                              dtype=self.compute_dtype))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, i, attn_fn)
                                    for i in range(arch.num_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = None  # shares the embedding
        self.rotary = Rotary(*ropes[GLOBAL], max_positions)
        self.rotary_local = Rotary(*ropes[LOCAL], max_positions)
        self.softcap = arch.final_logit_softcapping
        self.fused_decode: FusedPath | None = None  # the platform's: always None here
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm) and m.weight.dtype != self.compute_dtype:
                m.weight = nn.Parameter(m.weight.to(self.compute_dtype), requires_grad=False)

    @classmethod
    def from_config(cls, arch: ModelArch, hf_cfg: Any, attn_fn: AttentionFn,
                    max_positions: int, compute_dtype: torch.dtype) -> Gemma3ForCausalLM:
        model = cls(arch, attn_fn, gemma3_ropes(hf_cfg, arch.head_dim), max_positions,
                    compute_dtype=compute_dtype)
        model.rotary.to(compute_dtype)
        model.rotary_local.to(compute_dtype)
        return model

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        arch = self.arch
        out = {"model.embed_tokens.weight": WeightTarget(self.embed),
               "model.norm.weight": WeightTarget(self.norm.weight)}
        if self.lm_head.weight is not None:
            out["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.attn
            for name, norm in (("input_layernorm", layer.input_norm),
                               ("post_attention_layernorm", layer.post_attn_norm),
                               ("pre_feedforward_layernorm", layer.pre_ff_norm),
                               ("post_feedforward_layernorm", layer.post_ff_norm),
                               ("self_attn.q_norm", a.q_norm), ("self_attn.k_norm", a.k_norm)):
                out[p + name + ".weight"] = WeightTarget(norm.weight)
            for kind, fused in (("weight", a.qkv.weight), ("bias", a.qkv.bias)):
                if fused is not None:
                    out[p + f"self_attn.q_proj.{kind}"] = WeightTarget(fused, 0, q)
                    out[p + f"self_attn.k_proj.{kind}"] = WeightTarget(fused, q, q + kv)
                    out[p + f"self_attn.v_proj.{kind}"] = WeightTarget(fused, q + kv, q + 2 * kv)
            out[p + "self_attn.o_proj.weight"] = WeightTarget(a.o.weight)
            if a.o.bias is not None:
                out[p + "self_attn.o_proj.bias"] = WeightTarget(a.o.bias)
            out.update(mlp_targets(layer.mlp, p + "mlp."))
        return out

    def bind_kv_cache(self, kv: torch.Tensor, heads_first: bool = False) -> None:
        groups = kv_groups_of(kv)
        for i, layer in enumerate(self.layers):
            views = [(plane_view(g[i, 0], heads_first), plane_view(g[i, 1], heads_first))
                     for g in groups]
            layer.attn.k_cache, layer.attn.v_cache = views[0]
            layer.attn.kv_groups = views

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)
        if h.dtype != self.compute_dtype:
            h = h.to(self.compute_dtype)
        h = h * self.embed_scale
        last = current_metadata().last_layer
        tables = {True: (self.rotary_local, self.rotary_local.cos[positions],
                         self.rotary_local.sin[positions]),
                  False: (self.rotary, self.rotary.cos[positions], self.rotary.sin[positions])}
        layers = self.layers
        x = layers[0].input_norm(h)
        for i, layer in enumerate(layers):
            rotary, cos, sin = tables[layer.is_local]
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else None
            if nxt is None and last is not None:
                return layer.forward_rows(h, x, cos, sin, rotary, last)
            x = layer(h, x, cos, sin, rotary, nxt)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.norm(hidden)
        lm = self.lm_head
        if lm.weight is None and not lm.is_packed:  # tied, unpacked
            logits = F.linear(h, self.embed.to(h.dtype))
        else:
            logits = lm(h)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def gemma3_ropes(cfg: Any, head_dim: int) -> dict[str, tuple[torch.Tensor, float]]:
    """Each layer type's rope (inverse frequencies, cos/sin scale), as transformers computes
    them: transformers 5 reads ``rope_parameters[layer_type]`` (the legacy ``rope_theta`` /
    ``rope_local_base_freq`` / ``rope_scaling`` keys are folded in by the config class, the
    scaling to the global layers only)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    out = {}
    for layer_type in (LOCAL, GLOBAL):
        p = params.get(layer_type)
        if not isinstance(p, dict):
            raise UnsupportedModelError(f"Gemma 3 config without rope_parameters[{layer_type!r}]")
        rope_type = p.get("rope_type", "default")
        if rope_type == "default":
            inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float)
                                             / head_dim))
            out[layer_type] = (inv, 1.0)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", layer_type=layer_type)
            out[layer_type] = (inv.float(), float(scale))
    return out
