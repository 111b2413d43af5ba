"""Phi-3 (``Phi3ForCausalLM``) against transformers, on tiny random checkpoints built by
transformers' own classes (``hf_models.PHI3_ARCHS``: GQA 2:1, 4:1 and 1:1, the fused
``qkv_proj``/``gate_up_proj`` tensors, LongRoPE with a partial rotary and tied embeddings, a
sliding window): the config read, the rope table on both sides of
``original_max_position_embeddings``, greedy tokens identical and logits within the fp32 bound
(1e-4 of the range) through chunked prefill and decodes, a prefix-cache hit, a bf16 checkpoint
within the stated 2 %, and TP=2.

LongRoPE's reference is transformers fed the first ``original_max_position_embeddings`` (L0)
tokens at once and every later one alone (``hf_incremental``): each position then gets the
factors kvrelay's static table gives it (short before L0, long from L0 on; see
``engine/models/phi3.py``). Within L0 that is also transformers' ``generate``, which is checked
as such; past L0 ``generate`` re-encodes the sequence with the long factors, which kvrelay does
not (a test states the difference)."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict
from typing import Any

import pytest
import torch
from hf_models import PHI3_ARCHS, hf_forward_logits, hf_greedy, load_hf_model, one_thread
from test_bf16_engine import BF16_KV_TOL, FP32_TOL
from test_engine_parity import GEN, GREEDY, check_prefix_hit, hf_tokens, make_core, prompts, run

from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.models.arch import arch_from_hf_config, load_model_config, plain_config
from kvrelay.engine.models.phi3 import Phi3ForCausalLM, Phi3Rotary
from kvrelay.engine.sequence import Sequence

PHI3 = sorted(PHI3_ARCHS)
L0 = 32  # phi3_longrope's original_max_position_embeddings


def _config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


# -- references ---------------------------------------------------------------------------------
@functools.cache
def hf_incremental(model_dir: str, ids: tuple[int, ...], n_new: int, first: int) \
        -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """transformers (fp32) fed ``ids[:first]`` in one forward and every later token in its own,
    then ``n_new`` greedy tokens one at a time: (the greedy tokens, the prompt's logits
    ``[len(ids), V]``, the logits after each greedy token ``[n_new, V]``)."""
    from transformers import DynamicCache

    model = load_hf_model(model_dir)
    with torch.inference_mode(), one_thread():
        cache = DynamicCache(config=model.config)
        first = min(first, len(ids))

        def step(tokens: list[int]) -> torch.Tensor:
            return model(torch.tensor([tokens]), past_key_values=cache,
                         use_cache=True).logits[0].float()

        prompt = torch.cat([step(list(ids[:first]))] + [step([t]) for t in ids[first:]])
        tokens, after = [int(prompt[-1].argmax())], []
        for _ in range(n_new):
            after.append(step([tokens[-1]])[-1])
            tokens.append(int(after[-1].argmax()))
    return tokens[:n_new], prompt, torch.stack(after)


def engine_logits(core: Any, prompt: list[int], tokens: list[int], chunk: int = 24) \
        -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's logits of every prompt row (in chunks of ``chunk``, each over the earlier
    ones in the paged cache) and after each of ``tokens[:-1]`` (decodes)."""
    runner, bm = core.runner, core.block_manager
    seq = Sequence("x", prompt + tokens, GREEDY)
    seq.num_prompt_tokens = len(prompt)
    assert bm.allocate(seq, seq.num_tokens)
    chunks = []
    for start in range(0, len(prompt), chunk):
        stop = min(start + chunk, len(prompt))
        chunks.append(runner.logits_for([ScheduledSeq(seq, stop - start)]))
        seq.num_computed_tokens = stop
    dec = []
    for _ in tokens[:-1]:
        dec.append(runner.logits_for([ScheduledSeq(seq, 1)])[0])
        seq.num_computed_tokens += 1
    bm.free(seq)
    return torch.cat(chunks), torch.stack(dec) if dec else torch.empty(0)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def reference(model_dir: str, prompt: list[int], n: int) \
        -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(greedy tokens, prompt logits, logits after tokens[:-1]) of the model's reference."""
    if _config(model_dir).get("rope_scaling"):  # LongRoPE: per-position factors
        tokens, prompt_logits, after = hf_incremental(model_dir, tuple(prompt), n, L0)
        return tokens, prompt_logits, after[:n - 1]
    ref = hf_greedy(model_dir, prompt, n)
    return ref.token_ids, hf_forward_logits(model_dir, prompt), ref.logits[1:]


def check_logits(core: Any, model_dir: str, tol: float, length: int = 50,
                 decodes: int = 8) -> None:
    prompt = prompts(2, (length,))[0]
    tokens, ref_prefill, ref_dec = reference(model_dir, prompt, decodes)
    got_prefill, got_dec = engine_logits(core, prompt, tokens)
    err_p, err_d = rel_err(got_prefill, ref_prefill), rel_err(got_dec, ref_dec)
    assert err_p < tol and err_d < tol, (model_dir, err_p, err_d)


# -- the config and the rope ----------------------------------------------------------------------
@pytest.mark.parametrize("name", PHI3)
def test_arch_agrees_with_autoconfig(hf_model_dir, name: str) -> None:
    from transformers import AutoConfig

    d = hf_model_dir(name)
    _, arch = load_model_config(d)
    assert plain_config(_config(d)) is None  # AutoConfig's reading (longrope, its defaults)
    auto = AutoConfig.from_pretrained(d, local_files_only=True)
    fields = asdict(arch_from_hf_config(auto))
    assert {**asdict(arch), "identity": None} == {**fields, "identity": None}
    spec = PHI3_ARCHS[name].config
    assert arch.family == "phi3" and not (arch.qkv_bias or arch.o_bias or arch.mlp_bias)
    assert arch.num_kv_heads == spec.get("num_key_value_heads", 2)
    assert arch.layer_windows == (spec.get("sliding_window"),) * arch.num_layers
    assert not arch.is_moe and not arch.attention_sinks


def test_longrope_table_is_transformers_short_before_l0_and_long_from_l0(hf_model_dir) -> None:
    """Rope tables of transformers' own rotary module: positions < L0 in a forward of L0 tokens
    (short factors), positions >= L0 in one that reaches past L0 (long); kvrelay's table holds
    each position's, with the attention factor, over the first 3/4 of each head."""
    d = hf_model_dir("phi3_longrope")
    hf = load_hf_model(d)
    cfg, arch = load_model_config(d)
    model = Phi3ForCausalLM.from_config(arch, cfg, None, 128, torch.float32)
    rot = model.rotary
    assert isinstance(rot, Phi3Rotary) and rot.rotary_dim == 12 and rot.cos.shape == (128, 6)
    x = torch.zeros(1, 1, 16)
    with torch.no_grad():
        short = hf.model.rotary_emb(x, torch.arange(L0)[None])
        long = hf.model.rotary_emb(x, torch.arange(128)[None])
    assert hf.model.rotary_emb.attention_scaling > 1.0  # sqrt(1 + ln 32 / ln 32)
    for table, ours in ((short[0], rot.cos), (short[1], rot.sin)):
        torch.testing.assert_close(ours[:L0], table[0, :, :6], rtol=0, atol=1e-6)
    for table, ours in ((long[0], rot.cos), (long[1], rot.sin)):
        torch.testing.assert_close(ours[L0:], table[0, L0:, :6], rtol=0, atol=1e-6)
        assert (ours[:L0] - table[0, :L0, :6]).abs().max() > 1e-2  # the factors differ


# -- through the engine ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", PHI3)
def test_greedy_tokens_and_logits_match_transformers(hf_model_dir, name: str) -> None:
    """A mixed batch's greedy tokens, then one 50-token prompt's logits through chunks and
    decodes, against transformers in fp32 (LongRoPE: past L0, fed as kvrelay's table rotates)."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir)
    model = core.runner.model
    assert isinstance(model, Phi3ForCausalLM)
    # the fused CPU decode layers take a whole-head rope only (not Phi-4-mini's partial one)
    partial = model.rotary.rotary_dim < model.arch.head_dim
    assert partial == (name == "phi3_longrope")
    if partial:
        assert model.fused_decode is None
    ps = prompts(1, (1, 7, 16, 33))
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    seen: set[int] = set()
    for i, p in enumerate(ps):
        ref = reference(model_dir, p, GEN)[0]
        seen.update(ref)
        assert got[f"r{i}"] == ref, f"{name} prompt of {len(p)} tokens"
    assert len(seen) >= 10, "degenerate reference model"
    check_logits(core, model_dir, tol=FP32_TOL)


def test_longrope_within_l0_is_transformers_generate(hf_model_dir) -> None:
    """Prompt and output within L0 tokens: exactly transformers' ``generate`` (every position
    short); past L0 ``generate`` re-encodes with the long factors, kvrelay does not: its logits
    then differ from a one-shot forward over a longer prompt by far more than the bound."""
    d = hf_model_dir("phi3_longrope")
    core = make_core(d)
    prompt = prompts(7, (20,))[0]
    ref = hf_greedy(d, prompt, L0 - 20)
    assert run(core, {"a": (prompt, GREEDY)})["a"][:L0 - 20] == ref.token_ids
    got_prefill, got_dec = engine_logits(core, prompt, ref.token_ids)
    assert rel_err(got_prefill, hf_forward_logits(d, prompt)) < FP32_TOL
    assert rel_err(got_dec, ref.logits[1:]) < FP32_TOL
    longer = prompts(8, (48,))[0]
    got_prefill, _ = engine_logits(core, longer, [0])
    one_shot = hf_forward_logits(d, longer)  # every position long
    assert rel_err(got_prefill[:L0], one_shot[:L0]) > 1e-2
    assert rel_err(got_prefill, hf_incremental(d, tuple(longer), 1, L0)[1]) < FP32_TOL


@pytest.mark.parametrize("name", ["phi3_swa", "phi3_longrope"])
def test_chunked_prefill_with_a_prefix_cache_hit(hf_model_dir, name: str) -> None:
    model_dir = hf_model_dir(name)
    core = make_core(model_dir)
    if name != "phi3_longrope":
        check_prefix_hit(core, model_dir)  # 24-token chunks over 40 cached tokens
    else:  # the same, against the per-position reference
        base = prompts(3, (41,))[0]
        longer = base + prompts(4, (9,))[0]
        run(core, {"a": (base, GREEDY)})
        got = run(core, {"b": (longer, GREEDY)})["b"]
        assert got == reference(model_dir, longer, GEN)[0]
    assert core.stats().prefix_cache_hits >= 40


def test_bf16_checkpoint_within_the_stated_tolerance(hf_model_dir) -> None:
    """A bf16 Phi-4-mini-like checkpoint (LongRoPE, partial rotary, tied): logits within 2 % of
    the range of transformers in fp32 over the same weights with a bf16 KV cache, 1e-4 with an
    fp32 one (``test_bf16_engine``'s bounds), past L0."""
    d = hf_model_dir("phi3_longrope", dtype=torch.bfloat16)
    for kv, tol in (("auto", BF16_KV_TOL), ("float32", FP32_TOL)):
        core = make_core(d, kv_cache_dtype=kv)
        assert core.runner.dtype == torch.bfloat16
        check_logits(core, d, tol=tol, length=40)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["phi3", "phi3_longrope"])
def test_tp2_matches_transformers(hf_model_dir, name: str) -> None:
    """TP=2 on CPU (gloo): each rank half the heads of the fused q/k/v and half of gate/up;
    greedy tokens identical and logits within 1e-4, as at TP=1."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir, tensor_parallel_size=2, tp_timeout_s=20.0)
    try:
        a = core.runner.model.layers[0].attn
        assert a.num_heads == 2
        ps = prompts(1, (7, 33))
        got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == reference(model_dir, p, GEN)[0], (name, len(p))
        check_logits(core, model_dir, tol=FP32_TOL)
    finally:
        core.runner.close()


def test_hf_tokens_is_generate(hf_model_dir) -> None:
    """The plain-rope reference is ``generate``'s (so the checks above hold transformers'
    own decoding loop, not just ours of it)."""
    d = hf_model_dir("phi3")
    p = prompts(1, (16,))[0]
    assert hf_tokens(d, tuple(p), 8) == hf_incremental(d, tuple(p), 8, L0)[0]
