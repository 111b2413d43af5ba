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


def test_prompt_logits_are_computed_in_row_chunks(monkeypatch) -> None:
    """A long prompt chunk's logits come a few rows at a time (fp32 logits of every row were
    ~12 GB at 8192 rows on a real vocabulary), with the same logprobs as all rows at once; a
    decode row beside it keeps its place in the step's rows."""
    from types import SimpleNamespace

    from kvrelay.engine import prompt_logprobs as pl
    from kvrelay.engine.kv_connector import ScheduledSeq

    monkeypatch.setattr(pl, "ROWS_PER_CHUNK", 7)
    g = torch.Generator().manual_seed(0)
    d, vocab, n = 8, 50, 40
    weight = torch.randn(d, vocab, generator=g)
    sizes: list[int] = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        sizes.append(h.shape[0])
        return h @ weight

    tokens = [random.Random(1).randrange(vocab) for _ in range(n)]
    seq = SimpleNamespace(num_computed_tokens=3, num_prompt_tokens=n, token_ids=tokens,
                          sampling=SimpleNamespace(prompt_logprobs=2), prompt_logprobs=[])
    other = SimpleNamespace(num_computed_tokens=5, num_prompt_tokens=5, token_ids=[1] * 6,
                            sampling=SimpleNamespace(prompt_logprobs=None), prompt_logprobs=[])
    hidden = torch.randn(n - 3 + 1, d, generator=g)  # 37 prompt rows, then the decode row
    pl.record_prompt_logprobs(compute_logits, [ScheduledSeq(other, 1), ScheduledSeq(seq, n - 3)],
                              hidden)
    assert max(sizes) <= 7 and sum(sizes) == n - 4, sizes  # the last row scores nothing
    ref = (hidden[:n - 4] @ weight).log_softmax(-1)
    assert [lp.token_id for lp in seq.prompt_logprobs] == tokens[4:]
    want = ref.gather(1, torch.tensor(tokens[4:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in seq.prompt_logprobs]), want,
                          atol=1e-5)
    assert [[t for t, _ in lp.top] for lp in seq.prompt_logprobs] == \
        ref.topk(2, dim=-1).indices.tolist()
    assert other.prompt_logprobs == []


def test_prompt_logprobs_of_a_long_prompt_are_refused(demo_model_dir) -> None:
    """echo + logprobs on a prompt over MAX_PROMPT_LOGPROB_TOKENS: a 400 that says why."""
    from router_in_process import RouterInProcess

    from kvrelay.common.limits import MAX_PROMPT_LOGPROB_TOKENS

    with RouterInProcess(demo_model_dir) as r:
        body = {"model": "demo", "max_tokens": 1, "echo": True, "logprobs": 1,
                "prompt": [1] * (MAX_PROMPT_LOGPROB_TOKENS + 1)}
        resp = r.post("/v1/completions", json=body)
        assert resp.status_code == 400, resp.text[:300]
        assert "prompt logprobs" in resp.json()["error"]["message"]
