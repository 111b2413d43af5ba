"""Steps that carry prefill chunks beside decodes through the fused native layers
(engine/cpu/fused_decode.py, engine/cpu/csrc/decode_layer.c): the per-op path's results, bit
for bit, whether the chunk samples or not, with and without KV head groups and a window."""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import GREEDY, count_fused, make_core

from kvrelay.engine.cpu import gemm
from kvrelay.engine.cpu.fused_decode import MAX_MIXED_ROWS
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence

pytestmark = pytest.mark.skipif(not gemm.available(), reason="no native panel GEMM here")


def mixed_logits(core: EngineCore, chunk: int) -> list[torch.Tensor]:
    """Three sequences decode while a fourth prompt is prefilled beside them in three chunks
    of ``chunk`` tokens: the logits of every row of the three mixed steps."""
    runner, bm = core.runner, core.block_manager
    decs = []
    for i in range(3):
        seq = Sequence(f"d{i}", list(range(5 + i, 60)) + [7, 8, 9, 10], GREEDY)
        seq.num_prompt_tokens = 55 - i
        assert bm.allocate(seq, seq.num_tokens)
        runner.logits_for([ScheduledSeq(seq, seq.num_prompt_tokens)])
        seq.num_computed_tokens = seq.num_prompt_tokens
        decs.append(seq)
    long = Sequence("long", [(11 * i) % 97 + 3 for i in range(3 * chunk)], GREEDY)
    assert bm.allocate(long, long.num_tokens)
    out = []
    for _ in range(3):
        out.append(runner.logits_for([ScheduledSeq(long, chunk)]
                                     + [ScheduledSeq(s, 1) for s in decs]))
        long.num_computed_tokens += chunk
        for s in decs:
            s.num_computed_tokens += 1
    for s in (*decs, long):
        bm.free(s)
    return out


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("llama", {"kv_head_groups": 2}),
                                     ("mistral_swa", {}), ("qwen2", {}), ("llama_mha", {})])
def test_mixed_steps_equal_the_per_op_path(hf_model_dir, monkeypatch, arch: str,
                                           kw: dict) -> None:
    model_dir = hf_model_dir(arch)
    fused_core, plain_core = make_core(model_dir, **kw), make_core(model_dir, **kw)
    assert fused_core.runner.model.fused_decode is not None
    plain_core.runner.model.fused_decode = None
    taken = count_fused(monkeypatch)
    fused = mixed_logits(fused_core, 20)  # 20 tokens a chunk: past mistral_swa's 48 by the end
    assert taken == [True] * 6  # three prompts alone, then the three mixed steps
    plain = mixed_logits(plain_core, 20)
    assert [t.shape[0] for t in fused] == [23] * 3  # every row's logits
    for f, p in zip(fused, plain, strict=True):
        torch.testing.assert_close(f, p, rtol=0, atol=0)


def test_a_large_mixed_step_takes_the_per_op_path(hf_model_dir, monkeypatch) -> None:
    core = make_core(hf_model_dir("llama"), max_num_batched_tokens=512)
    taken = count_fused(monkeypatch)
    mixed_logits(core, MAX_MIXED_ROWS)  # a chunk of 128 rows and three decodes: 131 rows
    assert taken == [True] * 3 + [False] * 3


def test_the_engine_samples_what_the_per_op_path_samples(hf_model_dir, monkeypatch) -> None:
    """Through the engine: a long prompt chunked beside decodes, its last chunk sampling from
    the rows the last layer keeps (``last_layer``); tokens and logprobs identical."""
    model_dir = hf_model_dir("llama")
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    taken = count_fused(monkeypatch, mixed_only=True)

    def generate(core: EngineCore) -> dict[str, list]:
        core.add_request("a", list(range(3, 12)), sp)
        core.add_request("b", [(7 * i) % 89 + 3 for i in range(150)], sp)
        got: dict[str, list] = {"a": [], "b": []}
        while core.has_unfinished():
            for o in core.step():
                got[o.request_id] += list(zip(o.new_token_ids, o.logprobs, strict=True))
        return got

    fused = generate(make_core(model_dir, max_num_batched_tokens=24))
    assert any(taken)  # mixed steps went through the fused layers
    plain_core = make_core(model_dir, max_num_batched_tokens=24)
    plain_core.runner.model.fused_decode = None
    assert fused == generate(plain_core)
    assert len(fused["b"]) == 12


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("llama", {"kv_head_groups": 2}),
                                     ("mistral_swa", {}), ("qwen2", {"kv_cache_dtype": "float32"})])
def test_bf16_mixed_steps_equal_the_per_op_path(hf_model_dir, monkeypatch, arch: str,
                                                kw: dict) -> None:
    """A bf16 checkpoint (bf16 panels and, but for the fp32 case, a bf16 KV cache, in head
    groups too): prefill chunks beside decodes through the fused layers, bit for bit."""
    model_dir = hf_model_dir(arch, dtype=torch.bfloat16)
    fused_core, plain_core = make_core(model_dir, **kw), make_core(model_dir, **kw)
    if fused_core.runner.model.fused_decode is None:
        pytest.skip("no bf16 panels here")
    want_kv = torch.float32 if kw.get("kv_cache_dtype") == "float32" else torch.bfloat16
    assert fused_core.runner.kv.dtype == want_kv
    plain_core.runner.model.fused_decode = None
    taken = count_fused(monkeypatch)
    fused = mixed_logits(fused_core, 20)
    assert taken == [True] * 6
    plain = mixed_logits(plain_core, 20)
    for f, p in zip(fused, plain, strict=True):
        torch.testing.assert_close(f, p, rtol=0, atol=0)
