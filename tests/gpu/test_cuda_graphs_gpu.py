"""CUDA graphs for decode steps against eager steps on the GPU (bf16, flash-attn): the same
sequences decoded step after step by an engine that replays captured graphs and by one with
--enforce-eager, over batch sizes that hit every captured size, padded ones included, and one
past the bound (which runs eagerly)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.cuda.graphs import capture_sizes
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence

pytest.importorskip("flash_attn")

BF16_REL = 3e-2  # max |graph - eager| / max |eager|: bf16 kernels over different batch shapes
MAX_BATCH = 16


def _core(model_dir: str, device: str, **kw: Any) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        model_dir, device=device, dtype="bfloat16", attention_backend="flash", num_blocks=64,
        block_size=256, max_model_len=1024, cuda_graph_max_batch=MAX_BATCH, seed=0, **kw))


def _seqs(core: EngineCore, rng: random.Random, n: int) -> list[Sequence]:
    """``n`` sequences of varied prompt lengths, prefilled eagerly but for their decode tail."""
    out = []
    for i in range(n):
        prompt = rng.randrange(1, 300)
        s = Sequence(f"s{i}", [rng.randrange(3, 500) for _ in range(prompt + 40)],
                     SamplingParams())
        assert core.block_manager.allocate(s, s.num_tokens)
        if prompt > 1:
            core.runner.logits_for([ScheduledSeq(s, prompt)])
        s.num_computed_tokens = prompt
        out.append(s)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_decode_matches_eager(hf_model_dir, gpu: str, arch: str) -> None:
    model_dir = hf_model_dir(arch)
    graphed, eager = _core(model_dir, gpu), _core(model_dir, gpu, enforce_eager=True)
    graphs = graphed.runner.decode_graphs
    assert eager.runner.decode_graphs is None
    assert graphs is not None and sorted(graphs.captured) == capture_sizes(MAX_BATCH)
    assert graphed.runner.num_usable_blocks == graphed.runner.kv_spec.num_blocks - 1
    assert graphed.block_manager.num_blocks == graphed.runner.num_usable_blocks
    usable = graphed.runner.num_usable_blocks
    rng_g, rng_e = random.Random(0), random.Random(0)
    sg, se = _seqs(graphed, rng_g, 24), _seqs(eager, rng_e, 24)
    pick = random.Random(1)
    sizes = [1, 2, 3, 4, 5, 8, 11, 16, 7, 13, 17, 24, 6]  # 17 and 24 exceed MAX_BATCH
    for step in range(36):
        n = sizes[step % len(sizes)]
        idx = pick.sample(range(24), n)
        sched_g = [ScheduledSeq(sg[i], 1) for i in idx]
        sched_e = [ScheduledSeq(se[i], 1) for i in idx]
        want = eager.runner.logits_for(sched_e).float()
        order = sorted(range(n), key=lambda j: sched_e[j].seq.num_computed_tokens)
        ref = torch.empty_like(want)
        ref[torch.tensor(order, device=want.device)] = want
        if n <= MAX_BATCH:
            got = graphs.logits(sched_g).float()
        else:
            assert not graphs.handles(sched_g)
            got = graphed.runner.logits_for(sched_g).float()
            got = got[torch.argsort(torch.tensor(order, device=got.device))]
        assert got.shape == ref.shape and torch.isfinite(got).all()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < BF16_REL, (step, n, rel)
        for i in idx:
            sg[i].num_computed_tokens += 1
            se[i].num_computed_tokens += 1
    torch.cuda.synchronize()
    # The padding rows wrote only the scratch block: every real block holds what eager wrote.
    kg = graphed.runner.kv[:, :, :usable].float()
    ke = eager.runner.kv[:, :, :usable].float()
    assert ((kg - ke).abs().max() / ke.abs().max()).item() < BF16_REL


def test_engine_steps_replay_graphs(hf_model_dir, gpu: str, monkeypatch: pytest.MonkeyPatch) \
        -> None:
    """Through the engine: greedy decoding replays graphs for decode-only steps (and only
    those), and its first tokens agree with --enforce-eager."""
    model_dir = hf_model_dir("llama")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for name, kw in (("graphs", {}), ("eager", {"enforce_eager": True})):
        core = _core(model_dir, gpu, **kw)
        replays: list[int] = []
        graphs = core.runner.decode_graphs
        if graphs is not None:
            real = graphs.logits

            def spy(sched: Any, real: Any = real, replays: list[int] = replays) -> torch.Tensor:
                assert all(s.num_new_tokens == 1 for s in sched)
                replays.append(len(sched))
                return real(sched)

            monkeypatch.setattr(graphs, "logits", spy)
        rng = random.Random(5)
        for i, n in enumerate((5, 33, 70, 130, 9)):
            core.add_request(f"r{i}", [rng.randrange(3, 500) for _ in range(n)], greedy)
        got: dict[str, list[int]] = {}
        while core.has_unfinished():
            for o in core.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        results[name] = got
        assert (len(replays) > 0) == (name == "graphs")
    for rid, toks in results["eager"].items():
        assert len(results["graphs"][rid]) == len(toks)
        assert results["graphs"][rid][:6] == toks[:6], rid  # bf16: a near-tie can flip late
