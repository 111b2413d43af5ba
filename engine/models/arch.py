"""What the engine needs to know of a checkpoint's architecture, read from its config.json.

No torch here: the router reads the same config (vocabulary, context length, identity) and
never loads torch. The rope tables the model needs are in ``rope.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# Hugging Face architecture name -> family variant. All are the Llama decoder with small twists;
# Mixtral, Qwen3-MoE and Qwen2-MoE replace its MLP with a sparse mixture of experts
# (``models/moe.py``).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",  # its own decoder: models/gemma3.py
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Phi3ForCausalLM": "phi3",  # fused checkpoint tensors, LongRoPE: models/phi3.py
    "GptOssForCausalLM": "gpt_oss",  # attention sinks, biased experts: models/gpt_oss.py
    # Multi-head latent attention and DeepSeek's experts: models/deepseek.py
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]  # sliding window per layer (None = full attention)
    identity: str  # stable digest of the config: peers exchanging KV must agree on it
    # What the weights were written in (config.json's ``dtype``/``torch_dtype``: "bfloat16",
    # "float16", "float32"), or None where the config does not say: ``--dtype auto`` reads it.
    checkpoint_dtype: str | None = None
    # Mixture of experts (0 experts: a dense model). A sparse layer's MLP is a router over
    # ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, of which each token takes
    # ``num_experts_per_tok`` (softmax, then top-k; renormalised to sum 1 where
    # ``norm_topk_prob``); ``sparse_layers`` says which layers are sparse (Qwen3-MoE's
    # ``decoder_sparse_step``/``mlp_only_layers`` resolved; the others keep the dense MLP of
    # ``intermediate_size``).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()
    # Shared experts (Qwen2-MoE): a sparse layer's SwiGLU of ``shared_expert_intermediate_size``
    # (0: none) that every token takes besides its routed experts, its output scaled by
    # ``sigmoid(shared_expert_gate(x))`` where ``shared_expert_gate``.
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # Gemma 3: scores scale by ``query_pre_attn_scalar ** -0.5`` (None: by ``head_dim``'s, as
    # every other family); logits are soft-capped at ``final_logit_softcapping`` where set.
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # gpt-oss: each query head has a learned logit that joins its softmax's denominator and
    # attends to nothing (an attention sink); only backends that take sinks can serve it.
    attention_sinks: bool = False
    # DeepSeek-V2/V3: multi-head latent attention (``kv_lora_rank`` > 0). The KV cache then
    # holds one plane of one shared "head" per token: the normalised latent (``kv_lora_rank``)
    # and the rotated rope key (``qk_rope_head_dim``), so ``num_kv_heads`` is 1 and
    # ``head_dim`` their sum (what every cache, transfer and tier sizes by); the query and
    # output heads are ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim`` wide; q goes
    # through a ``q_lora_rank`` bottleneck where set. Gating: ``topk_method`` ("greedy",
    # "group_limited_greedy": softmax scores; "noaux_tc": V3's sigmoid scores with a selection
    # bias), top-k limited to ``topk_group`` of ``n_group`` expert groups, weights times
    # ``routed_scaling_factor``; the shared experts (``shared_expert_intermediate_size``) ungated.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope dims' checkpoint layout is interleaved pairs
    topk_method: str = ""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        assert len(self.layer_windows) == self.num_layers
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (False,) * self.num_layers)
        assert len(self.sparse_layers) == self.num_layers
        if any(self.sparse_layers) and not (
                1 <= self.num_experts_per_tok <= self.num_experts
                and self.moe_intermediate_size > 0):
            raise UnsupportedModelError(
                f"a mixture of experts needs 1 <= num_experts_per_tok "
                f"({self.num_experts_per_tok}) <= num_experts ({self.num_experts}) and a "
                f"positive moe_intermediate_size ({self.moe_intermediate_size})")

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return any(self.sparse_layers)

    @property
    def kv_latent(self) -> bool:
        """Whether the KV cache holds a latent per token (MLA) rather than K and V per head."""
        return self.kv_lora_rank > 0

    @property
    def kv_planes(self) -> int:
        """Planes of the KV cache per layer: K and V (2), or MLA's one latent plane (1)."""
        return 1 if self.kv_latent else 2


def supported_architecture(archs: Any) -> str | None:
    """The first of a config's ``architectures`` that kvrelay runs, if any."""
    return next((a for a in archs or () if a in SUPPORTED_ARCHITECTURES), None)


def load_hf_config(model_dir: str) -> Any:
    """The checkpoint's config, read offline: ``config.json`` itself where it states everything
    this engine reads (``plain_config``), else transformers' ``AutoConfig`` with its defaults.

    The first is what nearly every ``save_pretrained`` checkpoint gets, and it matters for a
    worker's start: in a process with torch, AutoConfig imports seconds of transformers' torch
    side (kernels, distributed tensors, dynamo) that kvrelay never uses."""
    return _config_from(model_dir, read_config_json(model_dir))


def load_model_config(model_dir: str) -> tuple[Any, ModelArch]:
    """The checkpoint's config (``load_hf_config``) and its ``ModelArch``, whose identity is a
    digest of ``config.json`` as written: the same whichever way the config was read and
    whatever transformers version is installed (router and workers may run different ones)."""
    raw = read_config_json(model_dir)
    cfg = _config_from(model_dir, raw)
    return cfg, arch_from_hf_config(cfg, raw=raw)


def read_config_json(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir!r} is not a checkpoint directory: no config.json")
    with open(path) as f:
        return json.load(f)


def _config_from(model_dir: str, raw: dict[str, Any]) -> Any:
    archs = raw.get("architectures") or []
    if supported_architecture(archs) is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in {model_dir}; "
            f"kvrelay supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    plain = plain_config(raw)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)


class PlainConfig(SimpleNamespace):
    """``config.json`` as attributes (what ``arch_from_hf_config`` and the rope tables read)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                  "max_position_embeddings", "tie_word_embeddings")


def plain_config(raw: dict[str, Any]) -> PlainConfig | None:
    """``raw`` as the config, when nothing this engine reads is left to a transformers default
    that differs between families (or to code: rope scaling types, computed layer types);
    None otherwise. tests/test_arch_config.py holds every accepted shape to AutoConfig's."""
    arch = supported_architecture(raw.get("architectures"))
    if arch is None or any(raw.get(k) is None for k in _REQUIRED_KEYS):
        return None
    family = SUPPORTED_ARCHITECTURES[arch]
    if family == "gemma3":
        return None  # defaults (layer types, two rope tables) are Gemma3TextConfig's code
    if family in ("phi3", "gpt_oss", *DEEPSEEK_FAMILIES):
        return None  # rope and layer-type defaults (longrope, yarn) are their config's code
    if raw.get("partial_rotary_factor") not in (None, 1, 1.0):
        return None
    params = raw.get("rope_parameters")
    legacy = raw.get("rope_scaling")
    if isinstance(params, dict) and legacy is None:
        if params.get("rope_type", "default") != "default" or "rope_theta" not in params:
            return None
    elif params is None and legacy is None:
        if "rope_theta" not in raw:
            return None
    else:
        return None  # scaled rope: its tables come from transformers' own functions
    cfg = dict(raw)
    if cfg.get("head_dim") is None:
        if family in ("qwen2", "qwen3"):
            return None  # their configs default it to a constant, not hidden / heads
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if family in MOE_FAMILIES:
        if _num_experts(raw) is None or raw.get("num_experts_per_tok") is None:
            return None  # left to the config class's defaults (8 and 2; 128 and 8)
        cfg["num_experts"] = _num_experts(raw)
    if family == "mistral":
        if "sliding_window" not in raw:
            return None  # MistralConfig defaults it to 4096
    elif family == "mixtral":
        cfg.setdefault("sliding_window", None)  # MixtralConfig's default
    elif family in ("qwen3_moe", "qwen2_moe"):
        keys = ("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step")
        if family == "qwen2_moe":
            keys += ("shared_expert_intermediate_size",)
            cfg.setdefault("qkv_bias", True)  # Qwen2MoeConfig's default (older ones: always)
        if any(raw.get(k) is None for k in keys):
            return None
        if raw.get("use_sliding_window", False):
            return None  # refused by arch_from_hf_config, with AutoConfig's reading
        cfg["sliding_window"] = None  # as Qwen3MoeConfig/Qwen2MoeConfig drop it
        cfg["mlp_only_layers"] = list(raw.get("mlp_only_layers") or [])
    elif family in ("qwen2", "qwen3"):
        windowed = bool(raw.get("use_sliding_window", False))
        if not windowed:
            cfg["sliding_window"] = None  # as Qwen2Config/Qwen3Config drop it
        if raw.get("layer_types") is None:
            if windowed:
                return None  # the layer types would come from max_window_layers
            cfg["layer_types"] = ["full_attention"] * raw["num_hidden_layers"]
    return PlainConfig(**cfg)


def arch_from_hf_config(cfg: Any, *, raw: dict[str, Any] | None = None) -> ModelArch:
    """The architecture of ``cfg``; its identity digests ``raw`` (``config.json`` as written)
    when given, else ``cfg.to_dict()``."""
    archs = list(getattr(cfg, "architectures", None) or [])
    arch = supported_architecture(archs)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs!r}; kvrelay supports "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    family = SUPPORTED_ARCHITECTURES[arch]
    if family == "gemma3":
        gemma = _gemma3_fields(cfg)
    else:
        # DeepSeek's latent attention and gating: kept with Gemma's (the family's own fields)
        gemma = _deepseek_fields(cfg) if family in DEEPSEEK_FAMILIES else {}
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        rope_type = rope_parameters(cfg).get("rope_type", "default")
        if not (family == "phi3" and rope_type == "longrope"):  # phi3.py builds its table
            _check_rope_type(rope_type)
    num_heads = cfg.num_attention_heads
    num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    if family in DEEPSEEK_FAMILIES:  # the cache's one latent "head" (see ModelArch)
        num_kv, head_dim = 1, gemma["kv_lora_rank"] + gemma["qk_rope_head_dim"]
    attn_bias = bool(getattr(cfg, "attention_bias", False))
    n_layers = cfg.num_hidden_layers
    if family in ("qwen3_moe", "qwen2_moe") and getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"{arch} with use_sliding_window is not supported (transformers versions differ "
            "on which layers it windows)")
    if family == "gpt_oss" and getattr(cfg, "quantization_config", None):
        raise UnsupportedModelError(
            "a quantized gpt-oss checkpoint (MXFP4 experts) is not supported; serve a bf16 one")
    if family in ("mistral", "mixtral", "phi3"):  # Phi-3: one window (or none) for every layer
        w = getattr(cfg, "sliding_window", None)
        windows: tuple[int | None, ...] = (w,) * n_layers
    else:
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers
        w = getattr(cfg, "sliding_window", None)
        windows = tuple(w if t == "sliding_attention" else None for t in types)
    moe = _moe_fields(cfg, family, n_layers)
    if family == "qwen2_moe":  # q/k/v biases by its own key (older configs: always), no o bias
        attn_bias = bool(getattr(cfg, "qkv_bias", True))
    digest = hashlib.sha256(json.dumps(cfg.to_dict() if raw is None else raw, sort_keys=True,
                                       default=str).encode())
    return ModelArch(
        architecture=arch,
        family=family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=n_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps),
        max_position_embeddings=int(cfg.max_position_embeddings),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        # Mixtral's attention has no biases whatever its config says.
        qkv_bias=True if family == "qwen2" else attn_bias and family != "mixtral",
        o_bias=False if family in ("qwen2", "qwen2_moe") else attn_bias and family != "mixtral",
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)) and family not in MOE_FAMILIES
        and family not in DEEPSEEK_FAMILIES,
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        layer_windows=windows,
        identity=f"{arch}:{digest.hexdigest()[:16]}",
        checkpoint_dtype=checkpoint_dtype(cfg),
        **moe,
        **gemma,
        attention_sinks=family == "gpt_oss",
    )


def _check_rope_type(rope_type: str) -> None:
    if rope_type not in _STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}")


def _gemma3_fields(cfg: Any) -> dict[str, Any]:
    """Gemma 3's ``ModelArch`` fields, refusing by name what the engine does not implement:
    attention logit soft-capping (no attention backend applies it), bidirectional attention,
    an activation other than ``gelu_pytorch_tanh``, a rope type it has no table for."""
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(
            f"Gemma 3 with hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            "Gemma 3 with attn_logit_softcapping is not supported (no attention backend "
            "soft-caps scores)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention is not supported "
                                    "(a causal decoder only)")
    for params in (getattr(cfg, "rope_parameters", None) or {}).values():
        if isinstance(params, dict):
            _check_rope_type(params.get("rope_type", "default"))
    cap = getattr(cfg, "final_logit_softcapping", None)
    return dict(query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
                final_logit_softcapping=None if cap is None else float(cap))


def _deepseek_fields(cfg: Any) -> dict[str, Any]:
    """DeepSeek-V2/V3's ``ModelArch`` fields: the latent attention's sizes and the gating (the
    MoE fields themselves come from ``_moe_fields``). A layer is sparse from
    ``first_k_dense_replace`` on, every ``moe_layer_freq``-th (DeepSeek's own reading;
    transformers has no ``moe_layer_freq``, which is 1 in every released checkpoint)."""
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if not getattr(cfg, key, None):
            raise UnsupportedModelError(f"{cfg.architectures[0]} needs a positive {key}")
    if cfg.qk_rope_head_dim % 2:
        raise UnsupportedModelError(f"qk_rope_head_dim {cfg.qk_rope_head_dim} must be even")
    if getattr(cfg, "quantization_config", None):
        raise UnsupportedModelError(
            f"a quantized {cfg.architectures[0]} checkpoint (the Hub's V3/R1 hold FP8 "
            "block-scaled weights) is not supported; serve a bf16 one (DeepSeek's "
            "fp8_cast_bf16.py converts it)")
    v3 = SUPPORTED_ARCHITECTURES[supported_architecture(cfg.architectures)] == "deepseek_v3"
    method = "noaux_tc" if v3 else (getattr(cfg, "topk_method", None) or "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise UnsupportedModelError(f"topk_method {method!r} is not supported (greedy, "
                                    f"group_limited_greedy, noaux_tc)")
    q_lora = getattr(cfg, "q_lora_rank", None)
    return dict(kv_lora_rank=int(cfg.kv_lora_rank), q_lora_rank=int(q_lora) if q_lora else None,
                qk_nope_head_dim=int(cfg.qk_nope_head_dim),
                qk_rope_head_dim=int(cfg.qk_rope_head_dim), v_head_dim=int(cfg.v_head_dim),
                # V2 rotates interleaved pairs always; V3 where its config says (the default)
                rope_interleave=bool(getattr(cfg, "rope_interleave", True)) if v3 else True,
                topk_method=method, n_group=int(getattr(cfg, "n_group", None) or 1),
                topk_group=int(getattr(cfg, "topk_group", None) or 1),
                routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0))


def _num_experts(cfg: Any) -> int | None:
    """Routed experts per sparse layer: ``num_experts`` (Qwen3-MoE's configs on the Hub) or
    ``num_local_experts`` (Mixtral's, and what transformers 5 writes for both)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k, None)
    n = get("num_experts")
    return n if n is not None else get("num_local_experts")


def _moe_fields(cfg: Any, family: str, n_layers: int) -> dict[str, Any]:
    """The ``ModelArch`` fields of a mixture of experts (none for a dense family): Mixtral's
    every layer sparse with its top-k always renormalised; Qwen3-MoE's layer ``i`` sparse unless
    listed in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step`` (its config's reading),
    Qwen2-MoE's alike, with a gated shared expert."""
    if family == "gpt_oss":  # every layer sparse; a softmax over the top-k logits: renormalised
        return dict(num_experts=int(cfg.num_local_experts),
                    num_experts_per_tok=int(cfg.num_experts_per_tok),
                    moe_intermediate_size=int(cfg.intermediate_size), norm_topk_prob=True,
                    sparse_layers=(True,) * n_layers)
    if family in DEEPSEEK_FAMILIES:
        experts = int(getattr(cfg, "n_routed_experts", None) or 0)
        first = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
        freq = int(getattr(cfg, "moe_layer_freq", 1) or 1)
        shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        return dict(num_experts=experts, num_experts_per_tok=int(cfg.num_experts_per_tok or 0),
                    moe_intermediate_size=int(cfg.moe_intermediate_size),
                    norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
                    sparse_layers=tuple(experts > 0 and i >= first and i % freq == 0
                                        for i in range(n_layers)),
                    shared_expert_intermediate_size=shared * int(cfg.moe_intermediate_size))
    if family not in MOE_FAMILIES:
        return {}
    experts = int(_num_experts(cfg) or 0)
    if family == "mixtral":
        inter, norm = cfg.intermediate_size, True
        sparse = (experts > 0,) * n_layers
    else:
        inter, norm = cfg.moe_intermediate_size, bool(cfg.norm_topk_prob)
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                       for i in range(n_layers))
    shared = {}
    if family == "qwen2_moe":
        shared = dict(shared_expert_intermediate_size=int(cfg.shared_expert_intermediate_size),
                      shared_expert_gate=True)
    return dict(num_experts=experts, num_experts_per_tok=int(cfg.num_experts_per_tok),
                moe_intermediate_size=int(inter), norm_topk_prob=norm, sparse_layers=sparse,
                **shared)


CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_dtype(cfg: Any) -> str | None:
    """The dtype a config says its weights are in (transformers 5 writes ``dtype``, earlier
    versions ``torch_dtype``; AutoConfig may hold a ``torch.dtype``), None when it says none
    this engine knows."""
    for key in ("dtype", "torch_dtype"):
        value = getattr(cfg, key, None)
        if value is not None:
            name = str(value).removeprefix("torch.")
            return name if name in CHECKPOINT_DTYPES else None
    return None


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """Rope settings in transformers 5's ``rope_parameters`` form (legacy keys are folded in)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    return params
