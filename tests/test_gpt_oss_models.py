"""gpt-oss (``GptOssForCausalLM``) against transformers, on tiny random checkpoints built by
transformers' own classes (``hf_models.GPT_OSS_ARCHS``: 4 and 8 experts, top-1, -2 and -4, GQA
2:1, 4:1 and 1:1, windows of 16, 8 and 40 tokens alternating with full layers, YaRN, tied
embeddings, sinks and biases large enough to matter): the config read, the stacked experts cut
and de-interleaved at load, the grouped experts and the sink attention against their
definitions, greedy tokens identical and logits within the fp32 bound (1e-4 of the range) at a
context past every window through chunked prefill and decodes, a prefix-cache hit, a bf16
checkpoint within the stated 2 %, and TP=2 (experts sliced per rank, sinks with their heads).
Sinks run on both CPU backends: the native paged kernels (checked against the torch path, itself
checked against transformers' definition) and torch SDPA."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_models import GPT_OSS_ARCHS, load_hf_model
from test_bf16_engine import BF16_KV_TOL, FP32_TOL
from test_engine_parity import GEN, GREEDY, check_prefix_hit, hf_tokens, make_core, prompts, run
from test_gemma3_models import check_follow_up_turn, check_hybrid_decode
from test_phi3_models import check_logits

from kvrelay.engine.attention import SdpaBackend, StepLayout
from kvrelay.engine.attention.sdpa import sink_attention
from kvrelay.engine.cpu import attention as native
from kvrelay.engine.loader import iter_checkpoint
from kvrelay.engine.models.arch import (
    UnsupportedModelError,
    arch_from_hf_config,
    load_model_config,
    plain_config,
)
from kvrelay.engine.models.gpt_oss import GptOssForCausalLM, GptOssMoE
from kvrelay.engine.models.moe import enable_grouped_mm, grouped_mm_available

OSS = sorted(GPT_OSS_ARCHS)
# (experts, top-k, KV heads, windows per layer) of each test checkpoint.
EXPECTED = {
    "gpt_oss": (4, 2, 2, (16, None)),
    "gpt_oss_top1_mqa": (8, 1, 1, (None, 8, 8)),
    "gpt_oss_mha_tied": (8, 4, 4, (40, None)),
}


def _config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _loaded(model_dir: str) -> GptOssForCausalLM:
    """The model with its checkpoint loaded through its own targets, unpacked (fp32)."""
    cfg, arch = load_model_config(model_dir)
    model = GptOssForCausalLM.from_config(arch, cfg, None, 64, torch.float32)
    targets = model.checkpoint_targets()
    for name, tensor in iter_checkpoint(model_dir):
        targets[name].load(name, tensor)
    return model


# -- the config and the weights ---------------------------------------------------------------
@pytest.mark.parametrize("name", OSS)
def test_arch_agrees_with_autoconfig(hf_model_dir, name: str) -> None:
    from transformers import AutoConfig

    d = hf_model_dir(name)
    _, arch = load_model_config(d)
    assert plain_config(_config(d)) is None  # AutoConfig's reading (layer types, yarn)
    auto = AutoConfig.from_pretrained(d, local_files_only=True)
    assert {**asdict(arch), "identity": None} == \
        {**asdict(arch_from_hf_config(auto)), "identity": None}
    assert (arch.num_experts, arch.num_experts_per_tok, arch.num_kv_heads,
            arch.layer_windows) == EXPECTED[name]
    assert arch.family == "gpt_oss" and arch.attention_sinks and arch.norm_topk_prob
    assert arch.qkv_bias and arch.o_bias and all(arch.sparse_layers)
    assert arch.moe_intermediate_size == 32


def test_quantized_checkpoints_are_refused_by_name(hf_model_dir, tmp_path) -> None:
    saved = _config(hf_model_dir("gpt_oss"))
    (tmp_path / "config.json").write_text(json.dumps(
        {**saved, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(UnsupportedModelError, match="MXFP4"):
        load_model_config(str(tmp_path))


def test_stacked_experts_load_into_each_expert_deinterleaved(hf_model_dir) -> None:
    """Expert ``e``'s fused ``[gate; up]`` rows are the even / odd columns of the checkpoint's
    ``gate_up_proj[e]`` transposed (biases likewise), ``down`` its ``down_proj[e]`` transposed."""
    d = hf_model_dir("gpt_oss")
    model = _loaded(d)
    hf = load_hf_model(d)
    ours, theirs = model.layers[1].mlp, hf.model.layers[1].mlp
    assert isinstance(ours, GptOssMoE)
    ex = theirs.experts
    for e, expert in enumerate(ours.experts):
        torch.testing.assert_close(expert.gate_up.weight[:32], ex.gate_up_proj[e][:, 0::2].t())
        torch.testing.assert_close(expert.gate_up.weight[32:], ex.gate_up_proj[e][:, 1::2].t())
        torch.testing.assert_close(expert.gate_up.bias[:32], ex.gate_up_proj_bias[e][0::2])
        torch.testing.assert_close(expert.gate_up.bias[32:], ex.gate_up_proj_bias[e][1::2])
        torch.testing.assert_close(expert.down.weight, ex.down_proj[e].t())
        torch.testing.assert_close(expert.down.bias, ex.down_proj_bias[e])
    torch.testing.assert_close(ours.router.bias, theirs.router.bias)
    torch.testing.assert_close(model.layers[1].attn.sinks,
                               hf.model.layers[1].self_attn.sinks)


# -- the pieces against their definitions -------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_top1_mqa"])
def test_grouped_experts_equal_transformers_block(hf_model_dir, name: str) -> None:
    """The MoE block (router with bias, softmax over the top-k logits, clamped SwiGLU experts run
    grouped by expert) equals transformers' ``GptOssMLP`` on rows whose activations reach the
    clamp, for 1, 3 and 40 rows; and so does its grouped-GEMM path (CUDA's), where this torch
    has it on the CPU."""
    d = hf_model_dir(name)
    model = _loaded(d)
    ours, theirs = model.layers[0].mlp, load_hf_model(d).model.layers[0].mlp
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, 64, generator=gen) * 4.0 for rows in (1, 3, 40)]
    for x in xs:
        with torch.no_grad():
            ref = theirs(x[None])[0][0]
            gate_up = x @ theirs.experts.gate_up_proj[0] + theirs.experts.gate_up_proj_bias[0]
        assert gate_up.abs().max() > 7.0  # the clamp is exercised
        torch.testing.assert_close(ours(x), ref, rtol=1e-4, atol=1e-4)
    # CUDA's path, where torch has the grouped GEMM on this CPU too: the same outputs.
    if not grouped_mm_available(torch.device("cpu"), torch.float32):
        return
    loop = [ours(x) for x in xs]
    assert enable_grouped_mm(model, torch.device("cpu"), torch.float32) == len(model.layers)
    assert ours.stacked is not None and ours.stacked_bias is not None
    for x, want in zip(xs, loop, strict=True):
        torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (4, 4)])
def test_sink_attention_equals_the_softmax_with_a_sink_column(heads: int, kv_heads: int) -> None:
    """transformers' definition: the sink appended as an extra logit column, softmax, dropped;
    with a window mask and a causal one, over chunks of query rows."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, heads, 9, 16, generator=gen)
    k = torch.randn(2, kv_heads, 13, 16, generator=gen)
    v = torch.randn(2, kv_heads, 13, 16, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2
    qpos = torch.arange(4, 13)[:, None]
    kpos = torch.arange(13)[None, :]
    for mask in (kpos <= qpos, (kpos <= qpos) & (kpos > qpos - 5)):
        g = heads // kv_heads
        kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scores = (q @ kr.transpose(-1, -2)) * 0.25
        scores = scores.masked_fill(~mask, float("-inf"))
        col = sinks.view(1, heads, 1, 1).expand(2, heads, 9, 1)
        probs = F.softmax(torch.cat((scores, col), dim=-1), dim=-1)[..., :-1]
        ref = probs @ vr
        torch.testing.assert_close(sink_attention(q, k, v, mask, 0.25, sinks), ref)
        import kvrelay.engine.attention.sdpa as sdpa

        old = sdpa.SINK_CHUNK_SCORES
        sdpa.SINK_CHUNK_SCORES = 2 * heads * 13 * 2  # two query rows per chunk
        try:
            torch.testing.assert_close(sink_attention(q, k, v, mask, 0.25, sinks), ref)
        finally:
            sdpa.SINK_CHUNK_SCORES = old


@pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("heads,kv_heads,head_dim,ctx,window,kv_dtype", [
    (4, 2, 16, 40, None, torch.float32),
    (8, 1, 64, 700, None, torch.float32),  # decode contexts cut into partitions, merged
    (4, 4, 32, 600, 100, torch.bfloat16),
    (4, 2, 16, 33, 8, torch.float32),
])
def test_native_kernels_take_sinks_as_the_torch_path_does(heads: int, kv_heads: int,
                                                          head_dim: int, ctx: int,
                                                          window: int | None,
                                                          kv_dtype: torch.dtype) -> None:
    """The paged decode kernel (two sequences) and the paged prefill kernel (a chunk of up to 37
    rows over a cached prefix) with sinks, against the torch backend's sink attention over the
    same cache; and the sinks matter (without them the outputs differ)."""
    bs = 8
    per = -(-ctx // bs)
    gen = torch.Generator().manual_seed(ctx)
    kc = torch.randn(2 * per * bs, kv_heads, head_dim, generator=gen).to(kv_dtype)
    vc = torch.randn(2 * per * bs, kv_heads, head_dim, generator=gen).to(kv_dtype)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(2)]
    sinks = torch.randn(heads, generator=gen) * 2 + 4  # large enough to show over 700 keys
    nb, sb = native.NativeBackend(), SdpaBackend()
    for b in (nb, sb):
        b.bind_cache(kv_heads, head_dim, kv_dtype, torch.device("cpu"))
    scale = head_dim ** -0.5
    q = torch.randn(2, heads, head_dim, generator=gen)
    decode = StepLayout(bs, torch.tensor([t[-1] * bs for t in tables]), [1, 1], [ctx, ctx],
                        tables, 0)
    rows = min(37, ctx - 5)  # over a cached prefix: every key from the cache
    qp = torch.randn(rows, heads, head_dim, generator=gen)
    prefill = StepLayout(bs, torch.arange(rows), [rows], [ctx], tables[:1], 1)
    for qs, step in ((q, decode), (qp, prefill)):
        k = v = qs[:, :kv_heads]  # not read: the keys are the cache's
        got = nb(qs, k, v, kc, vc, nb.metadata(step), scale, window, sinks=sinks)
        ref = sb(qs, k, v, kc, vc, sb.metadata(step), scale, window, sinks=sinks)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        plain = nb(qs, k, v, kc, vc, nb.metadata(step), scale, window)
        assert (plain - got).abs().max() > 1e-3


# -- through the engine -----------------------------------------------------------------------
@pytest.mark.parametrize("name,backend", [(n, "auto") for n in OSS] + [("gpt_oss", "sdpa")])
def test_greedy_tokens_and_logits_match_transformers(hf_model_dir, name: str,
                                                     backend: str) -> None:
    """A mixed batch's greedy tokens (prompts up to 33 tokens, 24 generated: past every window),
    then one 50-token prompt's logits through 24-token chunks (each reading the earlier ones
    from the paged cache) and decodes, against transformers in fp32: on the native paged kernels
    (auto, where they build) and, for one checkpoint, on torch SDPA."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir, attention_backend=backend)
    model = core.runner.model
    assert isinstance(model, GptOssForCausalLM) and model.fused_decode is None
    assert core.runner.backend == ("native" if backend == "auto" and native.available()
                                   else "sdpa")
    if model.lm_head.is_packed:  # the platform packed the experts as it did the rest
        assert all(e.gate_up.is_packed and e.down.is_packed
                   for layer in model.layers for e in layer.mlp.experts)
    ps = prompts(1, (1, 7, 16, 33))
    free0 = core.block_manager.num_free_blocks
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    seen: set[int] = set()
    for i, p in enumerate(ps):
        ref = hf_tokens(model_dir, tuple(p), GEN)
        seen.update(ref)
        assert got[f"r{i}"] == ref, f"{name} prompt of {len(p)} tokens"
    assert len(seen) >= 10, "degenerate reference model"
    assert core.block_manager.num_free_blocks == free0
    check_logits(core, model_dir, tol=FP32_TOL)


def test_a_backend_without_sinks_is_replaced_by_sdpa(hf_model_dir, monkeypatch) -> None:
    """What flash-attn (no sinks) gets on CUDA, shown with the native backend told it has none:
    the runner serves the model on torch SDPA, tokens unchanged."""
    monkeypatch.setattr(native.NativeBackend, "supports_sinks", False)
    d = hf_model_dir("gpt_oss")
    core = make_core(d, attention_backend="native")
    assert core.runner.backend == "sdpa"
    p = prompts(1, (16,))[0]
    assert run(core, {"a": (p, GREEDY)})["a"] == hf_tokens(d, tuple(p), GEN)


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_top1_mqa"])
def test_chunked_prefill_with_a_prefix_cache_hit(hf_model_dir, name: str) -> None:
    model_dir = hf_model_dir(name)
    core = make_core(model_dir)
    check_prefix_hit(core, model_dir)  # 24-token chunks over 40 cached tokens
    assert core.stats().prefix_cache_hits >= 40


def test_bf16_checkpoint_within_the_stated_tolerance(hf_model_dir) -> None:
    """bf16 weights (experts and sinks included) stay bf16; logits within 2 % of the range of
    transformers in fp32 over the same weights with a bf16 KV cache, 1e-4 with an fp32 one."""
    d = hf_model_dir("gpt_oss", dtype=torch.bfloat16)
    for kv, tol in (("auto", BF16_KV_TOL), ("float32", FP32_TOL)):
        core = make_core(d, kv_cache_dtype=kv)
        assert core.runner.dtype == torch.bfloat16
        for layer in core.runner.model.layers:
            assert layer.attn.sinks.dtype == torch.bfloat16
            for lin in (layer.mlp.router, *(m for e in layer.mlp.experts
                                            for m in (e.gate_up, e.down))):
                k = lin.kernel
                held = [lin.weight] if k is None else [getattr(k, "panels", None),
                                                       getattr(k, "onednn", None)]
                assert all(t is None or t.dtype == torch.bfloat16 for t in held)
        check_logits(core, d, tol=tol, length=40)


@pytest.mark.parametrize("name,backend", [("gpt_oss", "auto"), ("gpt_oss_top1_mqa", "sdpa")])
def test_hybrid_kv_matches_transformers_holding_the_windows(hf_model_dir, name: str,
                                                             backend: str) -> None:
    """``--hybrid-kv auto`` (a page table per layer group: the windowed layers give back the
    pages behind their window): logits through chunks and decodes, a decode past the window
    that holds only the window in its windowed layers, a follow-up turn that finds the whole
    conversation cached and a branching prompt with a shorter hit; tokens transformers'."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir, hybrid_kv="auto", attention_backend=backend)
    assert core.runner.kv_plan is not None
    check_logits(core, model_dir, tol=FP32_TOL)
    check_hybrid_decode(core, model_dir, length=50)
    if backend == "auto":  # (the follow-up turn on SDPA: test_gemma3_models)
        check_follow_up_turn(core, model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name,hybrid", [("gpt_oss", "off"), ("gpt_oss_mha_tied", "off"),
                                         ("gpt_oss", "auto")])
def test_tp2_shards_experts_and_sinks_and_matches_transformers(hf_model_dir, name: str,
                                                               hybrid: str) -> None:
    """TP=2 on CPU (gloo): each rank half of every expert's FFN (the down bias on rank 0 only),
    the router whole, half the heads with their sinks; greedy tokens identical and logits within
    1e-4, as at TP=1 (and with the hybrid KV layout's page tables per layer group)."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir, tensor_parallel_size=2, tp_timeout_s=20.0, hybrid_kv=hybrid)
    try:
        layer = core.runner.model.layers[0]
        moe, attn = layer.mlp, layer.attn
        assert moe.experts[0].inter == 16 and moe.reduce is not None
        assert moe.router.out_features == moe.num_experts
        assert attn.num_heads == 2 and attn.sinks.shape == (2,)
        hf = load_hf_model(model_dir)
        torch.testing.assert_close(attn.sinks, hf.model.layers[0].self_attn.sinks[:2])
        ps = prompts(1, (7, 33))
        got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN), (name, len(p))
        check_logits(core, model_dir, tol=FP32_TOL)
    finally:
        core.runner.close()
