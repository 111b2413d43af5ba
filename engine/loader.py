"""Load a Hugging Face checkpoint directory (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from kvrelay.engine.attention import AttentionFn
from kvrelay.engine.models.arch import ModelArch, load_model_config
from kvrelay.engine.models.llama import LlamaForCausalLM
from kvrelay.engine.models.mlp import MLP
from kvrelay.engine.models.moe import SparseMoE
from kvrelay.engine.models.rope import rope_inv_freq
from kvrelay.engine.platform import Platform, platform_for
from kvrelay.engine.tp_shard import TPShard, shard_model, validate_tp

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (kvrelay loads "
                                f"safetensors checkpoints only)")
    return files


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class _Target:
    """Where one checkpoint tensor goes: a parameter, or a row slice of a fused parameter."""

    __slots__ = ("param", "start", "stop")

    def __init__(self, param: torch.Tensor, start: int | None = None, stop: int | None = None):
        self.param, self.start, self.stop = param, start, stop

    def view(self) -> torch.Tensor:
        return self.param if self.start is None else self.param[self.start:self.stop]


def _targets(model: LlamaForCausalLM) -> dict[str, _Target]:
    arch = model.arch
    out: dict[str, _Target] = {"model.embed_tokens.weight": _Target(model.embed),
                               "model.norm.weight": _Target(model.norm.weight)}
    if model.lm_head.weight is not None:
        out["lm_head.weight"] = _Target(model.lm_head.weight)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.attn, layer.mlp
        out[p + "input_layernorm.weight"] = _Target(layer.input_norm.weight)
        out[p + "post_attention_layernorm.weight"] = _Target(layer.post_attn_norm.weight)
        for kind, fused in (("weight", a.qkv.weight), ("bias", a.qkv.bias)):
            if fused is not None:
                out[p + f"self_attn.q_proj.{kind}"] = _Target(fused, 0, q)
                out[p + f"self_attn.k_proj.{kind}"] = _Target(fused, q, q + kv)
                out[p + f"self_attn.v_proj.{kind}"] = _Target(fused, q + kv, q + 2 * kv)
        out[p + "self_attn.o_proj.weight"] = _Target(a.o.weight)
        if a.o.bias is not None:
            out[p + "self_attn.o_proj.bias"] = _Target(a.o.bias)
        if a.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = _Target(a.q_norm.weight)
            out[p + "self_attn.k_norm.weight"] = _Target(a.k_norm.weight)
        if isinstance(m, SparseMoE):
            out.update(_moe_targets(m, p, arch))
        else:
            out.update(_mlp_targets(m, p + "mlp.", _DENSE_NAMES))
    return out


# A SwiGLU's checkpoint names: (gate, up, down). Mixtral's experts call them w1, w3, w2.
_DENSE_NAMES = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def _mlp_targets(m: MLP, prefix: str, names: tuple[str, str, str]) -> dict[str, _Target]:
    gate, up, down = names
    inter = m.inter
    out: dict[str, _Target] = {}
    for kind, fused in (("weight", m.gate_up.weight), ("bias", m.gate_up.bias)):
        if fused is not None:
            out[prefix + f"{gate}.{kind}"] = _Target(fused, 0, inter)
            out[prefix + f"{up}.{kind}"] = _Target(fused, inter, 2 * inter)
    out[prefix + f"{down}.weight"] = _Target(m.down.weight)
    if m.down.bias is not None:
        out[prefix + f"{down}.bias"] = _Target(m.down.bias)
    return out


def _moe_targets(moe: SparseMoE, layer_prefix: str, arch: ModelArch) -> dict[str, _Target]:
    """A sparse layer's router and experts, by the names their checkpoints use on the Hub (and
    transformers' ``save_pretrained`` writes): Mixtral's ``block_sparse_moe.gate`` and
    ``experts.N.w1/w3/w2``, Qwen3-MoE's ``mlp.gate`` and ``experts.N.gate_proj/up_proj/
    down_proj``."""
    if arch.family == "mixtral":
        prefix, names = layer_prefix + "block_sparse_moe.", _MIXTRAL_EXPERT_NAMES
    else:
        prefix, names = layer_prefix + "mlp.", _DENSE_NAMES
    out = {prefix + "gate.weight": _Target(moe.router.weight)}
    for e, expert in enumerate(moe.experts):
        out.update(_mlp_targets(expert, f"{prefix}experts.{e}.", names))
    return out


def load_model(model_dir: str, *, device: torch.device, dtype: torch.dtype,
               attn_fn: AttentionFn, max_positions: int,
               shard: TPShard | None = None, platform: Platform | None = None,
               compute_dtype: torch.dtype | None = None,
               model_config: tuple[Any, ModelArch] | None = None,
               ) -> tuple[LlamaForCausalLM, ModelArch]:
    """Build the model with its weights in ``dtype`` and its activations (norm weights, rope
    tables, the residual stream) in ``compute_dtype`` (default ``dtype``), load its weights, then
    hand it to ``platform`` (default: the device's, with its defaults) to pack for its kernels.
    With ``shard`` the model is cut to that tensor-parallel rank's part before packing.

    Each checkpoint tensor is copied straight into its parameter, converted on the way where
    the dtypes differ: a bf16 checkpoint loaded as bf16 never has an fp32 copy of anything
    larger than one norm (peak memory: the model plus the one tensor being read, which
    safetensors maps from the file). ``model_config``: ``load_model_config(model_dir)``, when
    the caller has read it already."""
    hf_cfg, arch = model_config or load_model_config(model_dir)
    inv_freq, rope_scale = rope_inv_freq(hf_cfg, arch.head_dim)
    act = dtype if compute_dtype is None else compute_dtype
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(arch, attn_fn, inv_freq.to(device), rope_scale, max_positions,
                                 compute_dtype=act)
    model.rotary.to(act)
    targets = _targets(model)
    loaded: set[str] = set()
    ignored = 0
    for name, tensor in iter_checkpoint(model_dir):
        target = targets.get(name)
        if target is None:
            if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
                ignored += 1  # tied head stored anyway; stale rope buffers of old checkpoints
                continue
            raise ValueError(f"unexpected weight {name!r} in {model_dir} for {arch.architecture}")
        view = target.view()
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(view.shape)}")
        view.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} weights: {shown}")
    if shard is not None:
        validate_tp(arch, shard.size)
        shard_model(model, shard)
    n_params = sum(p.numel() for p in model.parameters())
    platform = platform_for(device) if platform is None else platform
    kernel = platform.prepare_model(model, dtype)
    logger.info("loaded %s (%s, %d layers, %.1fM params) on %s as %s, linears: %s%s",
                model_dir, arch.architecture, arch.num_layers, n_params / 1e6, device, dtype,
                kernel, ", fused decode layers" if model.fused_decode is not None else "")
    return model.eval(), arch
