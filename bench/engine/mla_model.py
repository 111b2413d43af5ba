"""The engine benchmarks' multi-head latent attention: a mid-size random DeepSeek-V2 checkpoint
(DeepSeek-V2-Lite's layout shrunk: no q bottleneck, a 128 + 32 latent cache, heads of 64 + 32
and values of 64, 32 routed experts of which each token takes 4 plus 2 shared ones, the first
layer dense, hidden 512, 8 layers, 8 heads), written by transformers' own classes.

    .venv/bin/python -m bench.engine.throughput --mla --short --skip-hf
"""

from __future__ import annotations

import logging

from kvrelay.engine.demo_model import SPECIAL_IDS, save_random_checkpoint

logger = logging.getLogger(__name__)

MLA_SHAPE = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=128, qk_rope_head_dim=32,
                 head_dim=32, qk_nope_head_dim=64, v_head_dim=64, intermediate_size=1536,
                 n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=2,
                 moe_intermediate_size=384, first_k_dense_replace=1, topk_method="greedy",
                 max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)


def write_mla_model(out_dir: str, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Write the bench's DeepSeek-V2 (``MLA_SHAPE``) to ``out_dir`` in ``dtype``; returns it."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(**MLA_SHAPE, **SPECIAL_IDS)
    n_params = save_random_checkpoint(DeepseekV2ForCausalLM, config, out_dir, seed, dtype)
    logger.info("wrote the bench MLA model (%.1fM parameters, %s) to %s", n_params / 1e6, dtype,
                out_dir)
    return out_dir
