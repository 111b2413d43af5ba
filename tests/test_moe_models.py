"""Mixtures of experts (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers, on tiny random
checkpoints built by transformers' own classes (``hf_models.MOE_ARCHS``: 4 and 8 experts, top-1
and top-2, GQA 2:1, 1:1 and 4:1, tied embeddings, a sliding window, the Qwen MoEs' renormalised
top-k and dense layers among the sparse ones, Qwen2-MoE's gated shared expert and q/k/v biases):
the config read, the grouped expert computation against a per-token
reference, greedy tokens identical and logits within the fp32 bound (1e-4 of the range,
``test_engine_parity``) through the offline engine, chunked prefill with a prefix-cache hit, a
bf16 checkpoint within ``test_bf16_engine``'s stated bounds, and TP=2."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_models import MOE_ARCHS
from test_bf16_engine import BF16_KV_TOL, FP32_TOL
from test_engine_parity import (
    GEN,
    GREEDY,
    check_logits,
    check_prefix_hit,
    hf_tokens,
    make_core,
    prompts,
    run,
)

from kvrelay.engine.models.arch import (
    UnsupportedModelError,
    arch_from_hf_config,
    load_model_config,
    plain_config,
)
from kvrelay.engine.models.moe import SparseMoE, enable_grouped_mm, grouped_mm_available

MOE = sorted(MOE_ARCHS)
# What each test checkpoint's ModelArch says of its experts:
# (experts, top-k, moe_intermediate_size, norm_topk_prob, sparse layers).
EXPECTED = {
    "mixtral": (4, 2, 32, True, (True, True)),
    "mixtral_top1_mha": (8, 1, 32, True, (True, True)),
    "mixtral_tied_swa": (8, 2, 32, True, (True, True)),
    "qwen3_moe": (8, 2, 32, False, (True, True)),
    "qwen3_moe_norm": (4, 2, 32, True, (True, True, False, True)),
    "qwen3_moe_step2": (4, 1, 32, True, (False, True, False, True)),
    "qwen2_moe": (8, 2, 32, False, (True, True)),
    "qwen2_moe_norm": (4, 2, 32, True, (True, False, True)),
}
# Their shared expert: (shared_expert_intermediate_size, gated); (0, False) where none.
SHARED = {"qwen2_moe": (48, True), "qwen2_moe_norm": (64, True)}


def _config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _fields(cfg: Any) -> dict[str, Any]:
    arch = asdict(arch_from_hf_config(cfg))
    arch.pop("identity")
    return arch


# -- the config -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MOE)
def test_arch_reads_the_experts_and_plain_config_agrees_with_autoconfig(hf_model_dir, tmp_path,
                                                                        name: str) -> None:
    from transformers import AutoConfig

    d = hf_model_dir(name)
    _, arch = load_model_config(d)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size,
            arch.norm_topk_prob, arch.sparse_layers) == EXPECTED[name]
    assert arch.is_moe and arch.qk_norm == (arch.family == "qwen3_moe")
    assert (arch.shared_expert_intermediate_size, arch.shared_expert_gate) == \
        SHARED.get(name, (0, False))
    assert (arch.qkv_bias, arch.o_bias) == (arch.family == "qwen2_moe", False)
    if name == "mixtral_tied_swa":
        assert arch.layer_windows == (48, 48)
    saved = _config(d)
    assert plain_config(saved) is not None  # what save_pretrained writes is read directly
    moe_keys = ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "sliding_window",
                "head_dim", "shared_expert_intermediate_size", "qkv_bias")
    variants = [saved] + [{k: v for k, v in saved.items() if k != key}
                          for key in moe_keys if key in saved]
    if "num_local_experts" in saved:  # the Hub's Qwen3-MoE configs say num_experts
        renamed = dict(saved)
        renamed["num_experts"] = renamed.pop("num_local_experts")
        variants.append(renamed)
    for i, raw in enumerate(variants):
        plain = plain_config(raw)
        if plain is None:
            continue  # AutoConfig's defaults decide
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(json.dumps(raw))
        auto = AutoConfig.from_pretrained(str(tmp_path / str(i)), local_files_only=True)
        assert _fields(plain) == _fields(auto), (name, i)


def test_identity_covers_the_expert_fields(hf_model_dir, tmp_path) -> None:
    saved = _config(hf_model_dir("qwen3_moe_norm"))
    identities = set()
    for change in ({}, {"num_experts_per_tok": 1}, {"norm_topk_prob": False},
                   {"mlp_only_layers": []}, {"decoder_sparse_step": 2}):
        d = tmp_path / str(len(identities))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**saved, **change}))
        identities.add(load_model_config(str(d))[1].identity)
    assert len(identities) == 5


def test_unsupported_moe_configs_are_refused_by_name(hf_model_dir, tmp_path) -> None:
    saved = _config(hf_model_dir("qwen3_moe"))
    cases = [
        ({"architectures": ["JambaForCausalLM"]},
         r"unsupported architecture.*Jamba.*MixtralForCausalLM.*Qwen3MoeForCausalLM"),
        ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ]
    cases = [(saved, change, match) for change, match in cases]
    cases.append((_config(hf_model_dir("qwen2_moe")), {"use_sliding_window": True,
                                                        "sliding_window": 64},
                  "Qwen2MoeForCausalLM with use_sliding_window"))
    for i, (base, change, match) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **change}))
        with pytest.raises(UnsupportedModelError, match=match):
            load_model_config(str(d))


# -- the block --------------------------------------------------------------------------------
def _per_token_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its own top-k experts, one at a time, then the shared expert (times
    its sigmoid gate): the definition."""
    out = torch.zeros_like(x)
    probs = torch.softmax(F.linear(x, moe.router.weight), dim=-1)
    for t in range(x.shape[0]):
        w, ids = torch.topk(probs[t], moe.top_k)
        if moe.norm_topk_prob:
            w = w / w.sum()
        for wi, e in zip(w.tolist(), ids.tolist(), strict=True):
            ex = moe.experts[e]
            gate, up = F.linear(x[t:t + 1], ex.gate_up.weight).split(ex.inter, dim=-1)
            out[t] += wi * F.linear(F.silu(gate) * up, ex.down.weight)[0]
        if moe.shared_expert is not None:
            ex = moe.shared_expert
            gate, up = F.linear(x[t:t + 1], ex.gate_up.weight).split(ex.inter, dim=-1)
            s = F.linear(F.silu(gate) * up, ex.down.weight)[0]
            if moe.shared_expert_gate is not None:
                s = s * torch.sigmoid(F.linear(x[t], moe.shared_expert_gate.weight))
            out[t] += s
    return out


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_step2", "qwen2_moe"])
def test_grouped_experts_equal_the_per_token_definition_one_call_per_active_expert(
        hf_model_dir, name: str, monkeypatch) -> None:
    from kvrelay.engine.models.llama import LlamaForCausalLM

    _, arch = load_model_config(hf_model_dir(name))
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch, None, torch.ones(arch.head_dim // 2), 1.0, 16)
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE))
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    calls: list[int] = []
    for e, ex in enumerate(moe.experts):
        orig = ex.forward
        monkeypatch.setattr(ex, "forward",
                            lambda x, e=e, orig=orig: (calls.append(e), orig(x))[1])
    for rows in (1, 3, 40):
        calls.clear()
        x = torch.randn(rows, arch.hidden_size)
        got = moe(x)
        ref = _per_token_reference(moe, x)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        ids, _ = moe.route(x)
        active = sorted(set(ids.view(-1).tolist()))
        assert calls == active  # one call per active expert, in ascending order


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_grouped_gemm_equals_the_definition_without_a_loop(hf_model_dir, name: str,
                                                            monkeypatch) -> None:
    """``torch._grouped_mm`` over the stacked experts (the CUDA platform's path, probed and run
    here on CPU in fp32): the per-token definition, empty groups included (1 row leaves most
    experts without one), and no expert's own forward runs."""
    from kvrelay.engine.models.llama import LlamaForCausalLM

    assert grouped_mm_available(torch.device("cpu"), torch.float32)
    _, arch = load_model_config(hf_model_dir(name))
    torch.manual_seed(0)
    model = LlamaForCausalLM(arch, None, torch.ones(arch.head_dim // 2), 1.0, 16)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    moe = model.layers[0].mlp
    x = torch.randn(40, arch.hidden_size)
    loop = moe(x)
    assert enable_grouped_mm(model, torch.device("cpu"), torch.float32) == sum(
        arch.sparse_layers)
    gate_up, down = moe.stacked
    for i in (0, 1):  # the experts' weights are views of the stacks: no second copy
        assert moe.experts[i].gate_up.weight.data_ptr() == gate_up[i].data_ptr()
        assert moe.experts[i].down.weight.data_ptr() == down[i].data_ptr()
    for ex in moe.experts:
        monkeypatch.setattr(ex, "forward", lambda x: pytest.fail("the loop ran"))
    for rows in (1, 3, 40):
        got = moe(x[:rows])
        torch.testing.assert_close(got, _per_token_reference(moe, x[:rows]), rtol=1e-5,
                                   atol=1e-5)
    torch.testing.assert_close(moe(x), loop, rtol=1e-6, atol=1e-6)


# -- through the engine -----------------------------------------------------------------------
@pytest.mark.parametrize("name", MOE)
def test_greedy_tokens_and_logits_match_transformers(hf_model_dir, name: str) -> None:
    """A mixed batch's greedy tokens, then one prompt's logits through chunks (each reading the
    earlier ones from the paged cache) and decodes, against transformers in fp32."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir)
    model = core.runner.model
    assert model.fused_decode is None  # the native fused layer is dense: MoE runs per op
    experts = [e for layer in model.layers if isinstance(layer.mlp, SparseMoE)
               for e in layer.mlp.experts]
    assert len(experts) == sum(EXPECTED[name][4]) * EXPECTED[name][0]
    shared = [layer.mlp.shared_expert for layer in model.layers
              if isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None]
    assert len(shared) == (sum(EXPECTED[name][4]) if name in SHARED else 0)
    if core.runner.model.lm_head.is_packed:  # the platform packed the experts as it did the rest
        assert all(e.gate_up.is_packed and e.down.is_packed for e in experts + shared)
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
    check_logits(core, model_dir, tol=1e-4)


def test_grouped_gemm_through_the_engine_matches_transformers(hf_model_dir, monkeypatch) -> None:
    """The engine with its linears unpacked (as on CUDA) and every sparse layer's experts in
    grouped GEMMs: greedy tokens and logits as transformers', as the loop gets them."""
    import kvrelay.engine.cpu.platform as cpu_platform

    model_dir = hf_model_dir("qwen2_moe_norm")
    monkeypatch.setattr(cpu_platform, "panels_available", lambda dtype: False)
    monkeypatch.setattr(cpu_platform, "onednn_packing_available", lambda dtype: False)
    core = make_core(model_dir)
    assert not core.runner.model.lm_head.is_packed
    assert enable_grouped_mm(core.runner.model, torch.device("cpu"), torch.float32) == 2
    ps = prompts(1, (7, 33))
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN)
    check_logits(core, model_dir, tol=1e-4)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_norm", "qwen2_moe"])
def test_chunked_prefill_with_a_prefix_cache_hit(hf_model_dir, name: str) -> None:
    model_dir = hf_model_dir(name)
    core = make_core(model_dir)
    check_prefix_hit(core, model_dir)  # 24-token chunks over 40 cached tokens
    assert core.stats().prefix_cache_hits >= 40


def test_the_offline_llm_serves_a_mixtral(hf_model_dir) -> None:
    from kvrelay.engine.llm import LLM

    model_dir = hf_model_dir("mixtral")
    ids = prompts(11, (19,))[0]
    out = LLM(model_dir, num_blocks=64, block_size=8).generate([ids], GREEDY)[0]
    assert out.token_ids == hf_tokens(model_dir, tuple(ids), GEN)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_norm", "qwen2_moe_norm"])
def test_bf16_checkpoint_within_the_stated_tolerance(hf_model_dir, name: str) -> None:
    """bf16 experts stay bf16 (no fp32 copy of any expert matrix); logits within 2 % of the
    range of transformers in fp32 over the same weights with a bf16 KV cache, 1e-4 with an fp32
    one (``test_bf16_engine``'s bounds)."""
    d = hf_model_dir(name, dtype=torch.bfloat16)
    for kv, tol in (("auto", BF16_KV_TOL), ("float32", FP32_TOL)):
        core = make_core(d, kv_cache_dtype=kv)
        assert core.runner.dtype == torch.bfloat16
        for layer in core.runner.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                for lin in (layer.mlp.router, *(m for e in layer.mlp.sharded_mlps()
                                                for m in (e.gate_up, e.down))):
                    k = lin.kernel
                    held = [lin.weight] if k is None else [getattr(k, "panels", None),
                                                           getattr(k, "onednn", None)]
                    assert all(t is None or t.dtype == torch.bfloat16 for t in held)
        check_logits(core, d, tol=tol, length=40)


# -- tensor parallelism -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral_tied_swa", "qwen3_moe_norm", "qwen2_moe_norm"])
def test_tp2_shards_every_expert_and_matches_transformers(hf_model_dir, name: str) -> None:
    """TP=2 on CPU (gloo): each rank holds half of every expert's FFN (the shared expert's too)
    and the whole router (and shared expert gate); greedy tokens identical and logits within
    1e-4, as at TP=1."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir, tensor_parallel_size=2, tp_timeout_s=20.0)
    try:
        moe = next(layer.mlp for layer in core.runner.model.layers
                   if isinstance(layer.mlp, SparseMoE))
        assert moe.experts[0].inter == 16 and moe.reduce is not None
        assert moe.router.out_features == moe.num_experts
        if moe.shared_expert is not None:
            assert moe.shared_expert.inter == SHARED[name][0] // 2
        ps = prompts(1, (7, 33))
        got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN), (name, len(p))
        check_logits(core, model_dir, tol=1e-4)
    finally:
        core.runner.close()
