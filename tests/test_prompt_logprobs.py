"""Prompt logprobs from the engine (what the prefill returns for ``echo`` with ``logprobs``)
against transformers on the same tiny checkpoint: through chunks, with the prompt's prefix
already cached (it must be recomputed, not skipped), and with alternatives."""

from __future__ import annotations

import random

import torch
from hf_models import hf_forward_logits

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.sampling_params import SamplingParams


def _prompt_logprobs(core: EngineCore, rid: str, prompt: list[int], k: int):
    core.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                 ignore_eos=True, prompt_logprobs=k))
    got = None
    while core.has_unfinished():
        for o in core.step():
            if o.prompt_logprobs is not None:
                assert got is None, "prompt logprobs come once, with the first token"
                got = o.prompt_logprobs
    assert got is not None
    return got


def test_prompt_logprobs_match_transformers(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama")
    prompt = [random.Random(3).randrange(3, 500) for _ in range(70)]
    ref = hf_forward_logits(model_dir, prompt).float().log_softmax(-1)
    core = EngineCore(EngineConfig.from_kwargs(model_dir, block_size=8, num_blocks=256,
                                               max_num_batched_tokens=24,
                                               long_prefill_threshold=6, seed=0))
    for rid in ("cold", "cached"):  # the second finds the prompt's blocks cached
        got = _prompt_logprobs(core, rid, prompt, 3)
        assert [lp.token_id for lp in got] == prompt[1:]
        want = ref[torch.arange(69), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor([lp.logprob for lp in got]), want, atol=1e-4)
        top_v, top_i = ref[:69].topk(3, dim=-1)
        assert [[t for t, _ in lp.top] for lp in got] == top_i.tolist()
        assert torch.allclose(torch.tensor([[v for _, v in lp.top] for lp in got]), top_v,
                              atol=1e-4)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
