"""Phi-3 (``Phi3ForCausalLM``: Phi-3 and Phi-3.5 mini/medium, Phi-4-mini) on the Llama decoder.

The decoder is Llama's; what differs is on disk and in the rope:

- the checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (in the
  row order of our fused parameters), so each loads whole into its fused weight;
- ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates only the first part of each head, the
  rest passes through;
- LongRoPE (``rope_type`` "longrope", the 128k variants): inverse frequencies divided by
  per-dimension ``short_factor`` or ``long_factor``, cos/sin scaled by an attention factor
  (``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` unless the config gives
  one).

Which factors a position gets: transformers picks one set per forward pass, by the sequence's
length: short while it fits in ``original_max_position_embeddings`` (L0), long once it is longer;
its ``generate`` even drops the cache and re-encodes the whole sequence with the long factors the
step the sequence outgrows L0. kvrelay's rope table is static per position instead: position
``p`` is rotated with the short factors when ``p < L0`` and with the long ones from ``L0`` on.
A token's K/V then depend on its position and its prefix alone, never on how long the sequence
later grows, which is what the prefix cache, chunked prefill and KV transfer need (a re-encode
would change cached blocks under a running sequence). What a user should expect:

- a sequence that stays within L0 tokens (prompt and output) is exactly transformers';
- past L0, kvrelay equals transformers fed the first L0 tokens at once and every later token
  one at a time (each step's length is then past L0 and its own position takes the long
  factors), which is what the tests check; transformers' ``generate`` and a one-shot forward
  over a longer prompt instead rotate the first L0 positions with the long factors too, so
  logits there differ (the keys of those L0 positions were rotated differently).

Phi-3's ``sliding_window`` (if set) applies to every layer, as Mistral's does. Tensor
parallelism, the platform's packing and the CPU's fused decode layers treat this model as Llama
(the fused layers decline a partial rotary: their rope kernel rotates whole heads).
"""

from __future__ import annotations

from typing import Any

import torch

from kvrelay.engine.attention import AttentionFn
from kvrelay.engine.models.arch import ModelArch, UnsupportedModelError, rope_parameters
from kvrelay.engine.models.llama import LlamaForCausalLM, Rotary
from kvrelay.engine.models.weights import WeightTarget, mlp_targets
from kvrelay.engine.pointwise import rope


class Phi3Rotary(Rotary):
    """Rotate-half RoPE over the first ``rotary_dim`` features of each head (all of them without
    a partial rotary), from a table whose positions from ``long_from`` on use ``long_inv_freq``
    (LongRoPE's long factors) and the earlier ones ``inv_freq``."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, max_positions: int,
                 rotary_dim: int, long_inv_freq: torch.Tensor | None = None,
                 long_from: int | None = None):
        super().__init__(inv_freq, scale, max_positions)
        self.rotary_dim = rotary_dim
        if long_inv_freq is not None and long_from is not None and long_from < max_positions:
            pos = torch.arange(long_from, max_positions, dtype=torch.float)
            freqs = pos[:, None] * long_inv_freq[None, :]
            self.cos[long_from:] = freqs.cos() * scale
            self.sin[long_from:] = freqs.sin() * scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == x.shape[-1]:
            return rope(x, cos, sin)
        return torch.cat((rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)


def phi3_rope(cfg: Any, head_dim: int) -> dict[str, Any]:
    """Phi3Rotary's arguments (but ``max_positions``) for a config, computed as transformers
    computes them: the short and long tables from its own LongRoPE function."""
    params = rope_parameters(cfg)
    factor = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(f"partial_rotary_factor {factor} gives a rotary dim of "
                                    f"{rotary_dim} for head_dim {head_dim}")
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        return dict(inv_freq=inv, scale=1.0, rotary_dim=rotary_dim)
    if rope_type != "longrope":
        raise UnsupportedModelError(f"Phi-3 with rope_type {rope_type!r} is not supported "
                                    f"(default or longrope)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    original = params.get("original_max_position_embeddings") \
        or getattr(cfg, "original_max_position_embeddings", None)
    if not original:
        raise UnsupportedModelError("Phi-3 longrope without original_max_position_embeddings")
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, scale = init(cfg, "cpu")
    long, _ = init(cfg, "cpu", seq_len=int(original) + 1)
    return dict(inv_freq=short.float(), scale=float(scale), rotary_dim=rotary_dim,
                long_inv_freq=long.float(), long_from=int(original))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's model with Phi-3's rope (:class:`Phi3Rotary`) and checkpoint names."""

    @classmethod
    def from_config(cls, arch: ModelArch, hf_cfg: Any, attn_fn: AttentionFn,
                    max_positions: int, compute_dtype: torch.dtype) -> Phi3ForCausalLM:
        if arch.qkv_bias or arch.o_bias or arch.mlp_bias:
            raise UnsupportedModelError("Phi-3 with biases is not supported (it has none)")
        r = phi3_rope(hf_cfg, arch.head_dim)
        model = cls(arch, attn_fn, r["inv_freq"], r["scale"], max_positions,
                    compute_dtype=compute_dtype)
        model.rotary = Phi3Rotary(max_positions=max_positions, **r).to(compute_dtype)
        return model

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        out = {"model.embed_tokens.weight": WeightTarget(self.embed),
               "model.norm.weight": WeightTarget(self.norm.weight)}
        if self.lm_head.weight is not None:
            out["lm_head.weight"] = WeightTarget(self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = layer.attn, layer.mlp
            out[p + "input_layernorm.weight"] = WeightTarget(layer.input_norm.weight)
            out[p + "post_attention_layernorm.weight"] = WeightTarget(layer.post_attn_norm.weight)
            out[p + "self_attn.qkv_proj.weight"] = WeightTarget(a.qkv.weight)  # [q; k; v]
            out[p + "self_attn.o_proj.weight"] = WeightTarget(a.o.weight)
            out[p + "mlp.gate_up_proj.weight"] = WeightTarget(m.gate_up.weight)  # [gate; up]
            out.update({k: t for k, t in mlp_targets(m, p + "mlp.").items()
                        if k.startswith(p + "mlp.down_proj.")})
        return out
