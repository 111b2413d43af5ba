"""The engine benchmarks' mixture of experts: a mid-size random Qwen3-MoE checkpoint
(Qwen3-30B-A3B's proportions shrunk: 32 experts of which each token takes 4, hidden 512, 8
layers, GQA 4:1), written by transformers' own classes, and what a step of it must read: the
experts a batch touches, counted as their expected number under uniform routing.

    .venv/bin/python -m bench.engine.throughput --moe --skip-hf
"""

from __future__ import annotations

import logging

import torch

from kvrelay.engine.demo_model import SPECIAL_IDS, save_random_checkpoint

logger = logging.getLogger(__name__)

# ~190M parameters of which ~37M run per token (all 32 experts: 151M; 4 of them: 19M).
MOE_SHAPE = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, intermediate_size=1536, num_experts=32,
                 num_experts_per_tok=4, moe_intermediate_size=384, norm_topk_prob=True,
                 decoder_sparse_step=1, max_position_embeddings=4096, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)


def write_moe_model(out_dir: str, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Write the bench's Qwen3-MoE (``MOE_SHAPE``) to ``out_dir`` in ``dtype``; returns it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**MOE_SHAPE, **SPECIAL_IDS)
    n_params = save_random_checkpoint(Qwen3MoeForCausalLM, config, out_dir, seed, dtype)
    logger.info("wrote the bench MoE (%.1fM parameters, %s) to %s", n_params / 1e6, dtype,
                out_dir)
    return out_dir


def expected_distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Experts that ``tokens`` rows touch in one layer, in expectation, each row choosing
    ``top_k`` distinct ones of ``experts`` uniformly: ``E (1 - (1 - k/E)^T)`` (at most
    ``min(E, T k)``). A trained router is less uniform than that, so this is what a step reads
    at most on average, a floor's numerator that flatters no row."""
    if experts == 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def measured_distinct_experts(core: object, tokens: int) -> float:
    """The mean over sparse layers of the experts the next ``core.step()`` touches (its routing
    recorded, then restored): a check on :func:`expected_distinct_experts` for this
    checkpoint's random router."""
    from kvrelay.engine.models.moe import SparseMoE

    counts: list[int] = []
    moes = [m for m in core.runner.model.modules() if isinstance(m, SparseMoE)]  # type: ignore[attr-defined]
    for m in moes:
        route = m.route

        def recording(x: torch.Tensor, route=route) -> tuple[torch.Tensor, torch.Tensor]:
            ids, w = route(x)
            if x.shape[0] == tokens:
                counts.append(int(ids.unique().numel()))
            return ids, w

        m.route = recording  # type: ignore[method-assign]
    try:
        core.step()  # type: ignore[attr-defined]
    finally:
        for m in moes:
            del m.route
    return sum(counts) / max(1, len(counts))
