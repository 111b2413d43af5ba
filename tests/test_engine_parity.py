"""The engine against transformers: same greedy tokens, logits within 1e-4 relative, for every
supported architecture, across block and chunk boundaries, prefix-cache hits, mixed batches and
forced preemption."""

from __future__ import annotations

import functools
import json
import os
import random

import pytest
import torch
from engine_runs import run_one
from hf_models import ARCHS, hf_forward_logits, hf_greedy

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.cpu import attention as native_kernels
from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.models.arch import UnsupportedModelError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.sequence import Sequence

BLOCK = 8
GEN = 24
LENGTHS = (1, 7, 16, 33, 70)  # across block (8) and chunk (24) boundaries


def make_core(model_dir: str, **kw: object) -> EngineCore:
    opts = dict(block_size=BLOCK, num_blocks=256, max_num_batched_tokens=24,
                long_prefill_threshold=6, seed=0)
    opts.update(kw)
    return EngineCore(EngineConfig.from_kwargs(model_dir, **opts))


def prompts(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


@functools.cache
def hf_tokens(model_dir: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return hf_greedy(model_dir, list(prompt), n).token_ids


def run(core: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]]) \
        -> dict[str, list[int]]:
    for rid, (ids, sp) in reqs.items():
        core.add_request(rid, ids, sp)
    got: dict[str, list[int]] = {rid: [] for rid in reqs}
    for _ in range(10_000):
        if not core.has_unfinished():
            break
        for o in core.step():
            got[o.request_id] += o.new_token_ids
    assert not core.has_unfinished()
    return got


GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_tokens_match_transformers_in_a_mixed_batch(hf_model_dir, arch: str,
                                                           backend: str) -> None:
    """Both CPU backends: the native paged kernels (auto) and pure torch SDPA (the fallback
    where nothing can be compiled)."""
    model_dir = hf_model_dir(arch)
    ps = prompts(1)
    core = make_core(model_dir, attention_backend=backend)
    native = backend == "auto" and native_kernels.available()
    assert core.runner.backend == ("native" if native else "sdpa")
    # head sizes 16 and 32: the native prefill too
    assert getattr(core.runner.attention, "native_prefill", False) == native
    free0 = core.block_manager.num_free_blocks
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    seen: set[int] = set()
    for i, p in enumerate(ps):
        ref = hf_tokens(model_dir, tuple(p), GEN)
        seen.update(ref)
        assert got[f"r{i}"] == ref, f"{arch} prompt of {len(p)} tokens"
    assert len(seen) >= 10, "degenerate reference model"
    assert core.block_manager.num_free_blocks == free0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_transformers_through_chunks_and_decodes(hf_model_dir, arch: str) -> None:
    model_dir = hf_model_dir(arch)
    check_logits(make_core(model_dir), model_dir, tol=1e-4, length=70, decodes=12)


def check_logits(core: EngineCore, model_dir: str, tol: float, length: int = 50,
                 decodes: int = 8) -> None:
    """One prompt's logits through 24-token chunks (each reading the earlier ones from the paged
    cache) and ``decodes`` decode steps, against transformers in fp32: the largest difference
    within ``tol`` of the largest logit, prefill and decode each."""
    prompt = prompts(2, (length,))[0]
    ref = hf_greedy(model_dir, prompt, decodes)
    ref_prefill = hf_forward_logits(model_dir, prompt)
    runner, bm = core.runner, core.block_manager
    seq = Sequence("x", prompt + ref.token_ids, GREEDY)
    seq.num_prompt_tokens = len(prompt)
    assert bm.allocate(seq, seq.num_tokens)
    chunks = []
    for start in range(0, length, 24):  # chunks over the cached prefix
        stop = min(start + 24, length)
        chunks.append(runner.logits_for([ScheduledSeq(seq, stop - start)]))
        seq.num_computed_tokens = stop
    dec = []
    for _ in ref.token_ids[:-1]:  # decode steps: one token over the paged cache
        dec.append(runner.logits_for([ScheduledSeq(seq, 1)])[0])
        seq.num_computed_tokens += 1
    err_p = float((torch.cat(chunks) - ref_prefill).abs().max() / ref_prefill.abs().max())
    ref_dec = ref.logits[1:]
    err_d = float((torch.stack(dec) - ref_dec).abs().max() / ref_dec.abs().max())
    assert err_p < tol and err_d < tol, (model_dir, err_p, err_d)
    bm.free(seq)


def check_prefix_hit(core: EngineCore, model_dir: str) -> None:
    """A prompt extending an earlier one finds its five full blocks cached, and its greedy
    tokens still equal transformers'."""
    base = prompts(3, (41,))[0]
    longer = base + prompts(4, (9,))[0]
    run(core, {"a": (base, GREEDY)})
    toks, cached = run_one(core, "b", longer, GREEDY)
    assert cached == 40  # five full blocks of the shared prefix
    assert toks == hf_tokens(model_dir, tuple(longer), GEN)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral_swa"])
def test_prefix_cache_hits_keep_tokens_identical(hf_model_dir, arch: str) -> None:
    model_dir = hf_model_dir(arch)
    core = make_core(model_dir)
    check_prefix_hit(core, model_dir)
    assert core.stats().prefix_cache_hits >= 40


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_by_recompute_keeps_tokens_identical(hf_model_dir, arch: str) -> None:
    model_dir = hf_model_dir(arch)
    ps = prompts(5, (30, 25, 35, 20))
    core = make_core(model_dir, num_blocks=14, max_num_batched_tokens=64,
                     enable_prefix_caching=False)
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    assert core.num_preemptions > 0
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN)
    assert core.block_manager.num_free_blocks == 14


def test_batch_composition_does_not_change_seeded_samples(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama")
    ps = prompts(6, (12, 30, 5))
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    alone = run(make_core(model_dir), {"x": (ps[0], sp)})["x"]
    mixed = run(make_core(model_dir), {
        "a": (ps[1], SamplingParams(max_tokens=20, temperature=1.0, seed=7)),
        "x": (ps[0], sp),
        "b": (ps[2], GREEDY)})["x"]
    assert alone == mixed and len(set(alone)) > 1


def test_abort_at_any_time_returns_every_block(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama")
    core = make_core(model_dir, num_blocks=64)
    free0 = core.block_manager.num_free_blocks
    rng = random.Random(0)
    for rnd in range(6):
        ids = [f"r{rnd}-{i}" for i in range(5)]
        for rid, p in zip(ids, prompts(rnd, (3, 20, 45, 60, 8)), strict=True):
            core.add_request(rid, p, SamplingParams(max_tokens=30, temperature=0,
                                                    ignore_eos=True))
        for _ in range(rnd * 2):  # mid-prefill, mid-chunk, mid-decode
            core.step()
        for rid in rng.sample(ids, len(ids)):
            core.abort(rid)
        while core.has_unfinished():
            core.step()
        assert core.block_manager.num_free_blocks == free0


def test_finish_returns_every_block_and_reports_reason(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama")
    core = make_core(model_dir)
    free0 = core.block_manager.num_free_blocks
    core.add_request("a", prompts(7, (10,))[0], SamplingParams(max_tokens=5, temperature=0))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert outs[-1].finished and outs[-1].finish_reason.value in ("length", "stop")
    assert core.block_manager.num_free_blocks == free0


def test_prompt_validation(hf_model_dir) -> None:
    core = make_core(hf_model_dir("llama"), max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        core.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="at most 63 prompt tokens"):
        core.add_request("b", [5] * 64, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request("c", [5, 10**6], GREEDY)


def test_unsupported_architecture_is_named(tmp_path, hf_model_dir) -> None:
    src = hf_model_dir("llama")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        EngineCore(EngineConfig.from_kwargs(str(tmp_path)))


def test_sharded_checkpoint_loads(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama_sharded")
    assert os.path.exists(os.path.join(model_dir, "model.safetensors.index.json"))
    p = prompts(8, (20,))[0]
    assert run(make_core(model_dir), {"a": (p, GREEDY)})["a"] == hf_tokens(model_dir, tuple(p),
                                                                              GEN)


@pytest.mark.parametrize("arch", ["llama_bias", "llama_tied"])
def test_panel_gemm_matches_the_onednn_path(hf_model_dir, arch: str) -> None:
    """Both CPU linear kernels (the native panel GEMM and oneDNN, see ``Linear``) give the same
    logits for a prefill and a batch-1 decode row, and greedy tokens equal to transformers'."""
    from kvrelay.engine.cpu import gemm, kernel_choice

    if not gemm.available():
        pytest.skip("the panel GEMM needs AVX2+FMA and a C compiler")
    model_dir = hf_model_dir(arch)
    prompt = prompts(9, (21,))[0]
    panels, packed = (make_core(model_dir, num_threads=2, linear_kernel=k)
                      for k in ("panels", "onednn"))
    assert panels.runner.model.lm_head.kernel.panels is not None
    assert kernel_choice.linear_kernel(packed.runner.model) == "onednn"
    logits = []
    for core in (panels, packed):
        seq = Sequence("x", prompt, GREEDY)
        assert core.block_manager.allocate(seq, len(prompt))
        first = core.runner.logits_for([ScheduledSeq(seq, 20)])[0]
        seq.num_computed_tokens = 20
        logits.append((first, core.runner.logits_for([ScheduledSeq(seq, 1)])[0]))  # one row
        core.block_manager.free(seq)
    for a, b in zip(*logits, strict=True):
        assert (a - b).abs().max() / b.abs().max() < 1e-5
    assert run(panels, {"a": (prompt, GREEDY)})["a"] == hf_tokens(model_dir, tuple(prompt), GEN)


def test_mlp_row_chunks_keep_prefill_logits(hf_model_dir) -> None:
    """A long prefill chunk runs the MLP in row chunks on CPU (see ``MLP``); forced small
    here, the logits still match transformers."""
    model_dir = hf_model_dir("llama_bias")
    prompt = prompts(10, (70,))[0]
    core = make_core(model_dir, max_num_batched_tokens=128)
    for layer in core.runner.model.layers:
        layer.mlp.chunk_rows = 16  # 70 rows: four chunks of 16 and one of 6
    seq = Sequence("x", prompt, GREEDY)
    assert core.block_manager.allocate(seq, len(prompt))
    got = core.runner.logits_for([ScheduledSeq(seq, 70)])
    ref = hf_forward_logits(model_dir, prompt)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4
    core.block_manager.free(seq)


def test_padded_rows_bound_the_waste_and_the_sizes() -> None:
    from kvrelay.engine.model_runner import padded_rows

    sizes = {padded_rows(n) for n in range(1, 2049)}
    assert len(sizes) == 80 and max(sizes) == 2048
    for n in range(1, 5000):
        p = padded_rows(n)
        assert p == n if n <= 32 else n <= p < n + n / 8, n
        assert padded_rows(p) == p


@pytest.mark.parametrize("arch", ["llama_bias", "qwen3", "mistral_swa", "llama_tied"])
def test_padded_steps_match_transformers_and_the_unpadded_path(hf_model_dir, arch: str) -> None:
    """CPU steps are padded to a bucketed row count (``padded_rows``); the padding writes no KV,
    joins no attention and samples nothing: tokens match transformers, logits the unpadded
    step's, and every block comes back. (oneDNN's linears only: the panel GEMM compiles
    nothing per shape, and its steps are not padded; see the next test for ``mixed``.)"""
    model_dir = hf_model_dir(arch)
    core = make_core(model_dir, max_num_batched_tokens=256, linear_kernel="onednn")
    assert core.runner.pad_above == 0  # oneDNN only: every step
    ps = prompts(11, (33, 70, 45, 5))  # one step of 153 prefill tokens: padded to 160
    free0 = core.block_manager.num_free_blocks
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN), i
    assert core.block_manager.num_free_blocks == free0

    seqs = [Sequence(f"s{i}", p, GREEDY) for i, p in enumerate(ps[:3])]
    logits = []
    for pad in (0, None):
        core.runner.pad_above = pad
        for s in seqs:
            assert core.block_manager.allocate(s, len(s.token_ids))
        logits.append(core.runner.logits_for([ScheduledSeq(s, len(s.token_ids)) for s in seqs]))
        for s in seqs:
            core.block_manager.free(s)
    assert logits[0].shape == logits[1].shape == (148, logits[0].shape[1])
    assert (logits[0] - logits[1]).abs().max() / logits[1].abs().max() < 1e-5


def test_mixed_pads_only_the_steps_onednn_runs(hf_model_dir) -> None:
    """Under ``mixed`` the panels run every step up to their rows unpadded (a padded decode step
    would also lose its fused native layers); longer ones, oneDNN's, are bucketed."""
    from kvrelay.engine.model_runner import padded_rows

    core = make_core(hf_model_dir("llama_bias"), max_num_batched_tokens=256,
                     linear_kernel="mixed")
    assert core.runner.pad_above == 64
    seqs = [Sequence(f"s{i}", p, GREEDY) for i, p in enumerate(prompts(12, (40, 30, 35)))]
    for s in seqs:
        assert core.block_manager.allocate(s, len(s.token_ids))
    one = core.runner.prepare([ScheduledSeq(seqs[0], 40)])  # 40 rows: the panels'
    assert one.input_ids.shape[0] == 40 and one.logits_indices.shape[0] == 1
    all3 = core.runner.prepare([ScheduledSeq(s, len(s.token_ids)) for s in seqs])  # 105 rows
    assert all3.input_ids.shape[0] == padded_rows(105) > 105
    assert all3.logits_indices.shape[0] == 3  # three sampled rows: the panels' again
    for s in seqs:
        core.block_manager.free(s)
