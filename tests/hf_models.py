"""Tiny random-weight Hugging Face checkpoints of every supported architecture, and HF's greedy.

``make_hf_model(out_dir, arch)`` builds the model with transformers' own classes and saves it as
a checkpoint directory (config.json + safetensors, sharded on request, plus the demo tokenizer),
so the engine can be checked token for token against ``hf_greedy`` (transformers' ``generate``,
fp32, CPU). Weights are scaled up from the usual 0.02 init so greedy output is not one token
repeated, and norm weights and biases are random so a weight the engine forgets to load shows.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvrelay.engine.demo_model import (
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    init_random_weights,
    quiet_transformers,
    write_demo_tokenizer,
)

BOS_ID, EOS_ID, PAD_ID = (SPECIAL_TOKENS.index(t) for t in ("<s>", "</s>", "<pad>"))

_BASE: dict[str, Any] = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=BOS_ID,
    eos_token_id=EOS_ID, pad_token_id=PAD_ID)


@dataclass(frozen=True)
class ArchSpec:
    config_class: str  # transformers config class name
    config: dict[str, Any] = field(default_factory=dict)  # over _BASE
    legacy_rope: bool = False  # write rope_theta/rope_scaling, as older checkpoints on disk do
    bias_std: float = 0.0
    embed_std: float = 1.0  # tied embeddings need less, or the model repeats its last token
    max_shard_size: str | None = None  # e.g. "200KB": several shards + index.json

    def __post_init__(self) -> None:
        if self.config_class not in ("LlamaConfig", "Qwen2Config", "Qwen3Config",
                                     "MistralConfig", "MixtralConfig", "Qwen3MoeConfig",
                                     "Qwen2MoeConfig",
                                     "Gemma3TextConfig", "Phi3Config", "GptOssConfig",
                                     "DeepseekV2Config", "DeepseekV3Config"):
            raise ValueError(f"unsupported config class {self.config_class!r}")


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaConfig"),
    # llama3 rope with wavelengths on all three sides of [16, 64]; legacy keys on disk.
    "llama3": ArchSpec("LlamaConfig", dict(num_hidden_layers=3, rope_theta=500000.0,
                                           rope_scaling=LLAMA3_ROPE), legacy_rope=True),
    "llama_tied": ArchSpec("LlamaConfig", dict(tie_word_embeddings=True), embed_std=0.3),
    "llama_mha": ArchSpec("LlamaConfig", dict(num_key_value_heads=4)),
    "llama_hd": ArchSpec("LlamaConfig", dict(head_dim=32)),  # 4 heads x 32 != hidden 64
    "llama_bias": ArchSpec("LlamaConfig", dict(attention_bias=True), bias_std=0.2),
    "llama_sharded": ArchSpec("LlamaConfig", dict(num_hidden_layers=3),
                              max_shard_size="300KB"),
    "qwen2": ArchSpec("Qwen2Config", dict(rope_theta=1000000.0), legacy_rope=True,
                      bias_std=0.2),
    "qwen3": ArchSpec("Qwen3Config", dict(head_dim=32, rope_theta=1000000.0,
                                          tie_word_embeddings=True), embed_std=0.3),
    "mistral": ArchSpec("MistralConfig", dict(sliding_window=4096)),
    "mistral_swa": ArchSpec("MistralConfig", dict(sliding_window=48)),  # masking matters
}

# Mixtures of experts (tests/test_moe_models.py), apart from ARCHS so that the dense families'
# parametrized tests keep their cases: expert counts 4 and 8, top-1 and top-2, GQA 2:1, 1:1 and
# 4:1, tied embeddings, Qwen3-MoE's renormalised top-k and dense layers among sparse ones.
_MOE = dict(intermediate_size=32)
MOE_ARCHS: dict[str, ArchSpec] = {
    "mixtral": ArchSpec("MixtralConfig", dict(_MOE, num_local_experts=4,
                                              num_experts_per_tok=2)),
    "mixtral_top1_mha": ArchSpec("MixtralConfig", dict(_MOE, num_local_experts=8,
                                                       num_experts_per_tok=1,
                                                       num_key_value_heads=4)),
    "mixtral_tied_swa": ArchSpec("MixtralConfig", dict(_MOE, num_local_experts=8,
                                                       num_experts_per_tok=2,
                                                       num_key_value_heads=1,
                                                       sliding_window=48,
                                                       tie_word_embeddings=True),
                                 embed_std=0.3),
    "qwen3_moe": ArchSpec("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, head_dim=32,
                                                 rope_theta=1000000.0,
                                                 tie_word_embeddings=True), embed_std=0.3),
    # Layers 0, 1 and 3 sparse (2 is in mlp_only_layers: a dense MLP of intermediate_size).
    "qwen3_moe_norm": ArchSpec("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=32,
                                                      norm_topk_prob=True, num_hidden_layers=4,
                                                      mlp_only_layers=[2])),
    # decoder_sparse_step 2: layers 1 and 3 sparse, top-1 of 4 (renormalised: weight 1).
    "qwen3_moe_step2": ArchSpec("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=1,
                                                       moe_intermediate_size=32,
                                                       norm_topk_prob=True,
                                                       num_hidden_layers=4,
                                                       decoder_sparse_step=2)),
    # Qwen2-MoE: routed experts plus a shared expert behind a sigmoid gate, q/k/v biases.
    "qwen2_moe": ArchSpec("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48,
                                                 rope_theta=1000000.0), bias_std=0.2),
    # Renormalised top-k, MHA, layer 1 dense (mlp_only_layers) between sparse layers 0 and 2.
    "qwen2_moe_norm": ArchSpec("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=64,
                                                      norm_topk_prob=True, num_hidden_layers=3,
                                                      num_key_value_heads=4,
                                                      mlp_only_layers=[1]), bias_std=0.2),
}

# Gemma 3 (tests/test_gemma3_models.py), apart as the MoE ones are: GQA 2:1, 4:1 (one KV head)
# and 1:1; head dims 16 and 32; windows of 24, 8 (one block) and 40 tokens; local:global
# patterns 2:1 (Gemma's 5:1 shortened), 1:1 and 3:1 out of order; query_pre_attn_scalar equal to
# the head dim and not; the global layers' linear rope scaling (Gemma 3 4B+), final logit
# soft-capping; tied and untied embeddings.
_LOCAL, _GLOBAL = "sliding_attention", "full_attention"
_GEMMA = dict(intermediate_size=96, rope_parameters={
    _LOCAL: {"rope_type": "default", "rope_theta": 10000.0},
    _GLOBAL: {"rope_type": "default", "rope_theta": 1000000.0}})
GEMMA3_ARCHS: dict[str, ArchSpec] = {
    "gemma3": ArchSpec("Gemma3TextConfig", dict(
        _GEMMA, num_hidden_layers=3, sliding_window=24, query_pre_attn_scalar=16,
        layer_types=[_LOCAL, _LOCAL, _GLOBAL], tie_word_embeddings=True), embed_std=0.03),
    "gemma3_mqa_scaled": ArchSpec("Gemma3TextConfig", dict(
        _GEMMA, num_hidden_layers=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
        query_pre_attn_scalar=48, layer_types=[_LOCAL, _GLOBAL], final_logit_softcapping=5.0,
        rope_parameters={_LOCAL: {"rope_type": "default", "rope_theta": 10000.0},
                         _GLOBAL: {"rope_type": "linear", "factor": 8.0,
                                   "rope_theta": 1000000.0}})),
    "gemma3_mha": ArchSpec("Gemma3TextConfig", dict(
        _GEMMA, num_hidden_layers=4, num_key_value_heads=4, sliding_window=40,
        query_pre_attn_scalar=64, layer_types=[_LOCAL, _GLOBAL, _LOCAL, _LOCAL],
        tie_word_embeddings=True), embed_std=0.03),
}
# Phi-3 (tests/test_phi3_models.py): GQA 2:1, 4:1 (one KV head) and 1:1; plain rope; LongRoPE
# with Phi-4-mini's partial rotary (0.75) and tied embeddings, its factors switching at position
# 32 (``original_max_position_embeddings``), written with the legacy keys as the Hub's configs
# are; a sliding window of 24 tokens.
_PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
                  "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                  "long_factor": [1.0, 3.0, 6.0, 12.0, 24.0, 40.0],
                  "original_max_position_embeddings": 32}
PHI3_ARCHS: dict[str, ArchSpec] = {
    "phi3": ArchSpec("Phi3Config", dict(num_hidden_layers=2)),
    "phi3_longrope": ArchSpec("Phi3Config", dict(
        num_key_value_heads=4, partial_rotary_factor=0.75, rope_parameters=_PHI3_LONGROPE,
        original_max_position_embeddings=32, tie_word_embeddings=True), embed_std=0.3,
        legacy_rope=True),
    "phi3_swa": ArchSpec("Phi3Config", dict(num_hidden_layers=3, num_key_value_heads=1,
                                            sliding_window=24)),
}

# gpt-oss (tests/test_gpt_oss_models.py): 4 and 8 experts, top-1, -2 and -4; GQA 2:1, 4:1 and
# 1:1; head dims 16 and 32; windows of 16, 8 (one block) and 40 tokens, sliding and full layers
# alternating and out of order; YaRN from 64 and from 32 positions to 1024; tied
# embeddings. Sinks and biases N(0, 0.5**2), so that the sinks weigh in the softmax.
_GPT_OSS = dict(intermediate_size=32)
_GPT_OSS_YARN = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 64,
                 "rope_theta": 150000.0}
GPT_OSS_ARCHS: dict[str, ArchSpec] = {
    "gpt_oss": ArchSpec("GptOssConfig", dict(_GPT_OSS, num_local_experts=4,
                                             num_experts_per_tok=2, sliding_window=16,
                                             rope_parameters=_GPT_OSS_YARN), bias_std=0.5),
    "gpt_oss_top1_mqa": ArchSpec("GptOssConfig", dict(
        _GPT_OSS, num_local_experts=8, num_experts_per_tok=1, num_key_value_heads=1,
        num_hidden_layers=3, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={**_GPT_OSS_YARN, "factor": 32.0, "original_max_position_embeddings": 32}),
        bias_std=0.5),
    "gpt_oss_mha_tied": ArchSpec("GptOssConfig", dict(
        _GPT_OSS, num_local_experts=8, num_experts_per_tok=4, num_key_value_heads=4,
        head_dim=32, sliding_window=40, tie_word_embeddings=True,
        rope_parameters=_GPT_OSS_YARN), bias_std=0.5, embed_std=0.3),
}

# DeepSeek-V2/V3 (tests/test_deepseek_models.py): multi-head latent attention with and without
# the q bottleneck (V2-Lite's plain q_proj), rope dims 8 and 16, V3's YaRN with mscale (from 64
# positions, written with the legacy rope_scaling keys as the Hub's V3 config is); V2's greedy
# and group-limited softmax gating, V3's sigmoid gating with its selection bias over 2 or 4
# groups; 4 and 8 routed experts, top-1 to top-3, one or two shared experts, dense first layers,
# attention biases, tied embeddings. Weight scales as everywhere (GAIN).
_DS = dict(intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
           qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, kv_lora_rank=32)
_DS_YARN = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
            "rope_theta": 10000.0}
DEEPSEEK_ARCHS: dict[str, ArchSpec] = {
    "deepseek_v3": ArchSpec("DeepseekV3Config", dict(
        _DS, num_hidden_layers=3, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5)),
    "deepseek_v3_yarn_tied": ArchSpec("DeepseekV3Config", dict(
        _DS, num_hidden_layers=2, q_lora_rank=24, qk_rope_head_dim=16, head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=3, n_shared_experts=2, n_group=2, topk_group=1,
        first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.0,
        rope_parameters=_DS_YARN, tie_word_embeddings=True), embed_std=0.3, legacy_rope=True),
    "deepseek_v2_lite": ArchSpec("DeepseekV2Config", dict(
        _DS, num_hidden_layers=2, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy")),
    "deepseek_v2": ArchSpec("DeepseekV2Config", dict(
        _DS, num_hidden_layers=2, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=1,
        n_shared_experts=1, first_k_dense_replace=0, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5, attention_bias=True),
        bias_std=0.2),
}

# transformers' model class of a config class, where it is not the config's name with
# "ForCausalLM" for "Config".
_MODEL_CLASSES = {"Gemma3TextConfig": "Gemma3ForCausalLM"}

# The weights' scale: matrices N(0, GAIN**2 / fan_in), embeddings N(0, 1).
GAIN = 1.5


def make_hf_model(out_dir: str, arch: str, seed: int = 0, **overrides: Any) -> str:
    """Write a tiny ``arch`` checkpoint (see ``ARCHS``) to ``out_dir`` and return it.

    ``overrides`` replace config fields (``num_hidden_layers=3``) or, for the keys
    ``legacy_rope``, ``bias_std``, ``embed_std`` and ``max_shard_size``, the spec's own settings;
    ``dtype`` (a ``torch.dtype``, default fp32) is what the weights are written in, and the
    config says so, as a real checkpoint's does.
    Each arch draws its weights from its own stream (``seed`` mixed with the arch's name), so
    two arches never share weights by accident.
    """
    import transformers

    specs = {**ARCHS, **MOE_ARCHS, **GEMMA3_ARCHS, **PHI3_ARCHS, **GPT_OSS_ARCHS,
             **DEEPSEEK_ARCHS}
    if arch not in specs:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(specs)}")
    spec = specs[arch]
    legacy_rope = overrides.pop("legacy_rope", spec.legacy_rope)
    bias_std = overrides.pop("bias_std", spec.bias_std)
    embed_std = overrides.pop("embed_std", spec.embed_std)
    max_shard_size = overrides.pop("max_shard_size", spec.max_shard_size)
    dtype = overrides.pop("dtype", torch.float32)
    kwargs = {**_BASE, **spec.config, **overrides}
    if kwargs["vocab_size"] < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least the tokenizer's {TOKENIZER_VOCAB_SIZE}")
    config = getattr(transformers, spec.config_class)(**kwargs)
    model_class = getattr(transformers, _MODEL_CLASSES.get(
        spec.config_class, spec.config_class.replace("Config", "ForCausalLM")))
    config.architectures = [model_class.__name__]
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    init_random_weights(model, seed * 1_000_003 + zlib.crc32(arch.encode()), gain=GAIN,
                        embed_std=embed_std, norm_jitter=0.3, bias_std=bias_std)
    gen = torch.Generator().manual_seed(seed + zlib.crc32(arch.encode()))
    with torch.no_grad():
        for name, buf in model.named_buffers():  # DeepSeek-V3's selection bias: a buffer
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    save_kw: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kw["max_shard_size"] = max_shard_size
    with quiet_transformers():
        model.save_pretrained(out_dir, **save_kw)
    if legacy_rope:
        to_legacy_rope_keys(os.path.join(out_dir, "config.json"))
    write_demo_tokenizer(out_dir)
    return out_dir


def to_legacy_rope_keys(config_path: str) -> None:
    """Rewrite transformers 5's ``rope_parameters`` as ``rope_theta`` + ``rope_scaling``."""
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    params = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", "default")
    cfg["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **params}
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


@functools.lru_cache(maxsize=16)
def load_hf_model(model_dir: str) -> Any:
    """transformers' model for ``model_dir`` in fp32 eval mode, eager attention (cached)."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None  # EOS stops only when asked (hf_greedy)
    return model


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch single-threaded for the duration: these models are far too small to gain from
    threads, and on a shared CPU intra-op threads that spin-wait make a call up to 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HFGreedy(NamedTuple):
    token_ids: list[int]  # generated ids (the prompt not included)
    logits: torch.Tensor  # [len(token_ids), vocab] fp32: the raw logits each id was chosen from


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int,
              eos_token_id: int | list[int] | None = None) -> HFGreedy:
    """transformers' greedy ``generate`` from ``prompt_ids``; EOS ends it only if given."""
    from transformers import GenerationConfig

    model = load_hf_model(model_dir)
    gen = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                           eos_token_id=eos_token_id, pad_token_id=PAD_ID, output_logits=True,
                           return_dict_in_generate=True)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.inference_mode(), one_thread():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             generation_config=gen)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float()
    return HFGreedy(tokens, logits[:len(tokens)])


def hf_forward_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """One forward pass over ``token_ids``: logits ``[len(token_ids), vocab]`` in fp32."""
    model = load_hf_model(model_dir)
    with torch.inference_mode(), one_thread():
        return model(torch.tensor([token_ids], dtype=torch.long)).logits[0].float()
