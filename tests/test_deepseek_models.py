"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, DeepSeek's mixture of experts)
against transformers, on tiny random checkpoints built by transformers' own classes
(``hf_models.DEEPSEEK_ARCHS``: with and without the q bottleneck, rope dims 8 and 16, YaRN with
mscale, V2's greedy and group-limited softmax gating, V3's sigmoid gating with a random
selection bias, 4 and 8 experts, top-1 to top-3, one and two shared experts, dense first layers,
attention biases, tied embeddings): the config read, the latent KV layout (one plane of
``kv_lora_rank + qk_rope_head_dim`` per token per layer), the MoE block against transformers',
greedy tokens identical and logits within the fp32 bound (1e-4 of the range) through the offline
engine (prefill up-projected, decode absorbed: both checked, on the native backend and on torch
SDPA), chunked prefill with a prefix-cache hit, a bf16 checkpoint within the stated bounds, and
TP=2 (query heads split, the latent replicated)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from hf_models import DEEPSEEK_ARCHS, load_hf_model
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

from kvrelay.engine.models.arch import UnsupportedModelError, load_model_config
from kvrelay.engine.models.deepseek import DeepseekForCausalLM
from kvrelay.engine.models.deepseek_moe import DeepseekMoE
from kvrelay.engine.models.mla import MLAttention, deinterleave_rows

DEEPSEEK = sorted(DEEPSEEK_ARCHS)
# (kv_lora_rank + rope dims, topk_method, sparse layers, shared expert width, q_lora_rank)
EXPECTED = {
    "deepseek_v3": (40, "noaux_tc", (False, True, True), 32, 24),
    "deepseek_v3_yarn_tied": (48, "noaux_tc", (True, True), 64, 24),
    "deepseek_v2_lite": (40, "greedy", (False, True), 64, None),
    "deepseek_v2": (40, "group_limited_greedy", (True, True), 32, 24),
}


def _config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


# -- the config and the layout ----------------------------------------------------------------
@pytest.mark.parametrize("name", DEEPSEEK)
def test_arch_reads_the_latent_attention_and_the_gating(hf_model_dir, name: str) -> None:
    _, arch = load_model_config(hf_model_dir(name))
    width, method, sparse, shared, q_lora = EXPECTED[name]
    assert (arch.num_kv_heads, arch.head_dim, arch.kv_planes, arch.kv_latent) == \
        (1, width, 1, True)
    assert (arch.topk_method, arch.sparse_layers, arch.shared_expert_intermediate_size,
            arch.q_lora_rank, arch.shared_expert_gate) == (method, sparse, shared, q_lora, False)
    assert arch.rope_interleave


def test_moe_layer_freq_and_first_k_dense_replace_place_the_dense_layers(hf_model_dir,
                                                                         tmp_path) -> None:
    """DeepSeek's own reading: sparse from ``first_k_dense_replace`` on, every
    ``moe_layer_freq``-th layer (transformers has no ``moe_layer_freq``: 1 in every release)."""
    saved = _config(hf_model_dir("deepseek_v3"))
    for i, (change, sparse) in enumerate([({"num_hidden_layers": 6, "moe_layer_freq": 2},
                                           (False, False, True, False, True, False)),
                                          ({"num_hidden_layers": 4, "first_k_dense_replace": 0},
                                           (True,) * 4),
                                          ({"first_k_dense_replace": 3}, (False,) * 3)]):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**saved, **change}))
        assert load_model_config(str(d))[1].sparse_layers == sparse, change


def test_unsupported_deepseek_configs_are_refused_by_name(hf_model_dir, tmp_path) -> None:
    saved = _config(hf_model_dir("deepseek_v2"))
    for i, (change, match) in enumerate([({"topk_method": "noaux"}, "topk_method 'noaux'"),
                                         ({"kv_lora_rank": 0}, "positive kv_lora_rank"),
                                         ({"hidden_act": "gelu"}, "hidden_act"),
                                         ({"quantization_config": {"quant_method": "fp8"}},
                                          "quantized DeepseekV2ForCausalLM.*bf16")]):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**saved, **change}))
        with pytest.raises(UnsupportedModelError, match=match):
            load_model_config(str(d))


def test_the_cache_holds_one_latent_plane_per_layer(hf_model_dir) -> None:
    """kv_lora_rank + rope elements per token per layer: 40 fp32 here, where the per-head K/V
    of the same 4 heads of 24 (keys) and 16 (values) would be 160."""
    core = make_core(hf_model_dir("deepseek_v3"))
    spec, kv = core.runner.kv_spec, core.runner.kv
    assert (spec.planes, spec.num_kv_heads, spec.head_dim) == (1, 1, 40)
    assert tuple(kv.shape) == (3, 1, spec.num_blocks, 8, 1, 40)
    assert spec.bytes_per_block_all_layers == 3 * 8 * 40 * 4
    assert spec.plane_block_offset(2, 0, 5) == ((2 * spec.num_blocks) + 5) * spec.block_bytes
    with pytest.raises(AssertionError):
        spec.plane_block_offset(0, 1, 0)  # no V plane
    assert core.runner.model.fused_decode is None  # the fused native layers decline MLA


def test_deinterleaving_the_rope_rows_keeps_the_rest() -> None:
    t = torch.arange(2 * 6).view(12, 1)  # 2 groups of 6 rows, rope rows 2..5 of each
    got = deinterleave_rows(t, 2, 6, 2, 4).view(-1).tolist()
    assert got == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


def test_the_multi_token_prediction_layer_is_skipped_at_load(hf_model_dir, tmp_path) -> None:
    """DeepSeek-V3's checkpoints carry a multi-token-prediction module as one layer past the
    decoder's (layer 61 of 61): loaded past, not refused; any other stray tensor still is."""
    import shutil

    from safetensors.torch import save_file

    d = tmp_path / "mtp"
    shutil.copytree(hf_model_dir("deepseek_v3"), d)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(4, 4),
               "model.layers.3.shared_head.norm.weight": torch.ones(4)},
              str(d / "mtp.safetensors"))
    core = make_core(str(d))
    assert len(core.runner.model.layers) == 3
    save_file({"model.layers.2.stray.weight": torch.zeros(2)}, str(d / "stray.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.2\.stray"):
        make_core(str(d))


# -- the experts ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2", "deepseek_v2_lite"])
def test_the_moe_block_equals_transformers(hf_model_dir, name: str) -> None:
    """The grouped experts behind DeepSeek's gating (V3: the selection bias picks, the
    unbiased scores weigh) and the shared experts: transformers' block's output."""
    d = hf_model_dir(name)
    core = make_core(d)
    hf = load_hf_model(d)
    model = core.runner.model
    assert isinstance(model, DeepseekForCausalLM)
    i = next(j for j, layer in enumerate(model.layers) if isinstance(layer.mlp, DeepseekMoE))
    ours, theirs = model.layers[i].mlp, hf.model.layers[i].mlp
    if ours.score_bias is not None:
        assert ours.score_bias.abs().max() > 0.1  # the checkpoint's bias was loaded
    torch.manual_seed(0)
    x = torch.randn(37, model.arch.hidden_size)
    with torch.inference_mode():
        ref = theirs(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


# -- through the engine -----------------------------------------------------------------------
@pytest.mark.parametrize("name", DEEPSEEK)
def test_greedy_tokens_and_logits_match_transformers(hf_model_dir, name: str,
                                                     monkeypatch) -> None:
    """A mixed batch's greedy tokens, then one prompt's logits through 24-token chunks (each
    up-projecting the earlier chunks' latents from the paged cache) and absorbed decodes (the
    native paged decode kernel over the latent plane), against transformers in fp32; the last
    layer on the sampled rows alone where the backend prunes it."""
    import kvrelay.engine.cpu.attention as native

    d = hf_model_dir(name)
    core = make_core(d)
    assert core.runner.attention.name == "native"
    calls: list[int] = []
    real = native.paged_decode
    monkeypatch.setattr(native, "paged_decode",
                        lambda q, *a, **k: (calls.append(q.shape[-1]), real(q, *a, **k))[1])
    pruned: list[int] = []
    rows = MLAttention.forward_rows
    monkeypatch.setattr(MLAttention, "forward_rows",
                        lambda self, *a: (pruned.append(1), rows(self, *a))[1])
    ps = prompts(1, (1, 7, 16, 33))
    free0 = core.block_manager.num_free_blocks
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    seen: set[int] = set()
    for i, p in enumerate(ps):
        ref = hf_tokens(d, tuple(p), GEN)
        seen.update(ref)
        assert got[f"r{i}"] == ref, f"{name} prompt of {len(p)} tokens"
    assert len(seen) >= 10, "degenerate reference model"
    assert core.block_manager.num_free_blocks == free0
    assert calls and set(calls) == {EXPECTED[name][0]}  # the absorbed decode, natively
    # The last layer on the rows read alone (absorbed, as decodes) where the native prefill
    # kernel's head size lets the backend prune (a latent + rope of 48 here, 576 in V3)
    assert bool(pruned) == core.runner.prune_last == (EXPECTED[name][0] % 16 == 0)
    check_logits(core, d, tol=1e-4)


def test_torch_sdpa_backend_matches_transformers(hf_model_dir) -> None:
    """The absorbed decode through SDPA's grouped decode (the latent plane as K and as V)."""
    d = hf_model_dir("deepseek_v3")
    core = make_core(d, attention_backend="sdpa")
    assert core.runner.attention.name == "sdpa"
    check_logits(core, d, tol=1e-4)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite"])
def test_chunked_prefill_with_a_prefix_cache_hit(hf_model_dir, name: str) -> None:
    d = hf_model_dir(name)
    core = make_core(d)
    check_prefix_hit(core, d)  # 24-token chunks over 40 cached tokens
    assert core.stats().prefix_cache_hits >= 40


def test_the_offline_llm_serves_a_deepseek(hf_model_dir) -> None:
    from kvrelay.engine.llm import LLM

    d = hf_model_dir("deepseek_v2")
    ids = prompts(11, (19,))[0]
    out = LLM(d, num_blocks=64, block_size=8).generate([ids], GREEDY)[0]
    assert out.token_ids == hf_tokens(d, tuple(ids), GEN)


def test_bf16_checkpoint_within_the_stated_tolerance(hf_model_dir) -> None:
    """bf16 weights stay bf16; logits within 2 % of the range of transformers in fp32 over the
    same weights with a bf16 latent cache, 1e-4 with an fp32 one."""
    d = hf_model_dir("deepseek_v3", dtype=torch.bfloat16)
    for kv, tol in (("auto", BF16_KV_TOL), ("float32", FP32_TOL)):
        core = make_core(d, kv_cache_dtype=kv)
        assert core.runner.dtype == torch.bfloat16
        assert core.runner.model.layers[0].attn.kv_b.dtype == torch.bfloat16
        check_logits(core, d, tol=tol, length=40)


# -- tensor parallelism -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite"])
def test_tp2_splits_the_heads_replicates_the_latent_and_matches_transformers(
        hf_model_dir, name: str) -> None:
    """TP=2 on CPU (gloo): each rank holds half of the query heads (q_b_proj's, or V2-Lite's
    q_proj's, rows; kv_b_proj's; o_proj's columns) and of every expert, and the whole latent
    cache; greedy tokens identical and logits within 1e-4, as at TP=1."""
    d = hf_model_dir(name)
    core = make_core(d, tensor_parallel_size=2, tp_timeout_s=20.0)
    try:
        a = core.runner.model.layers[0].attn
        assert a.num_heads == 2 and a.kv_b.shape[0] == 2 * (a.nope + a.v_dim)
        assert core.runner.kv_spec.head_dim == EXPECTED[name][0]  # the whole latent
        ps = prompts(1, (7, 33))
        got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == hf_tokens(d, tuple(p), GEN), (name, len(p))
        check_logits(core, d, tol=1e-4)
    finally:
        core.runner.close()


# -- the latent layout between workers --------------------------------------------------------
def test_transfer_layout_carries_the_latent_and_refuses_per_head_kv_naming_both() -> None:
    from kvrelay.engine.kv_cache import KVCacheSpec
    from kvrelay.kv_transfer.descriptors import layer_planes, region_descs
    from kvrelay.kv_transfer.layout import IncompatibleKVLayout, KVLayout, check_compatible

    latent = KVLayout.from_spec(KVCacheSpec(3, 1, 40, 8, 10, planes=1), "ds")
    assert KVLayout.from_bytes(latent.to_bytes()) == latent and latent.spec.planes == 1
    assert len(region_descs(0, latent, 0)) == 3 * 10  # one plane per layer
    assert layer_planes([0, 2], 1) == [0, 2] and layer_planes([0, 2], 2) == [0, 1, 4, 5]
    per_head = KVLayout.from_spec(KVCacheSpec(3, 1, 40, 8, 10), "ds")
    with pytest.raises(IncompatibleKVLayout) as e:
        check_compatible(latent, per_head, peer="d1")
    msg = str(e.value)
    assert "peer caches K and V per head (2 planes), we have a latent per token (1 plane" in msg
    assert "--model" in msg


def test_the_router_refuses_a_worker_of_another_kv_kind_naming_both() -> None:
    import dataclasses

    from test_kv_layout_handshake import F32, beat
    from test_kv_layout_handshake import run as run_registry

    from kvrelay.common.kv_layout import CacheLayout, KVLayoutMismatch

    latent = dataclasses.replace(F32, kv_kind="latent")
    assert CacheLayout.from_info(beat("d1", latent).worker) == latent

    def body(reg: Any) -> None:
        reg.heartbeat(beat("d1", latent))
        with pytest.raises(KVLayoutMismatch) as e:
            reg.heartbeat(beat("p1", F32))
        assert "kv_kind" in str(e.value) and "'kv' on worker p1" in str(e.value)
        assert "'latent' on the workers this router routes to (d1)" in str(e.value)
    run_registry(body)


def test_host_and_disk_tiers_keep_and_give_back_the_latent(hf_model_dir, tmp_path) -> None:
    """A prompt's latent blocks leave the pool for the host tier, then the disk tier, and come
    back: the tokens are those it had when computed, the prefix is a hit. A tier's slot is one
    block of every layer's one latent plane."""
    from test_kv_tiers import BLOCK, prompt, settle
    from test_kv_tiers import make_core as tier_core
    from test_kv_tiers import run as tier_run

    from kvrelay.engine.prefix_hash import block_hashes
    from kvrelay.engine.tiers.media import DEVICE, DISK, HOST

    d = hf_model_dir("deepseek_v3")
    slot = 3 * 1 * BLOCK * 40 * 4  # layers x planes x block x (latent + rope) x fp32
    core = tier_core(d, kv_offload_memory=40 * slot, kv_offload_dir=str(tmp_path),
                     kv_offload_disk=200 * slot)
    try:
        assert core.tiers is not None and core.tiers.slot_bytes == slot
        first = tier_run(core, "a0", prompt(0))[0]
        for s in (1, 2, 3):  # prompt 0 leaves the pool, then the host tier
            tier_run(core, f"a{s}", prompt(s))
        settle(core)
        h0 = block_hashes(prompt(0), BLOCK)
        sets = core.cached_hash_sets()
        assert set(h0) <= sets[DISK] and not set(h0) & (sets[DEVICE] | sets[HOST])
        again, cached = tier_run(core, "b0", prompt(0))
        assert again == first and cached == (160 - 1) // BLOCK * BLOCK
        st = core.stats().kv_tiers
        assert st[DISK].hit_blocks == cached // BLOCK and st[HOST].stored_blocks >= 4 * 20
        assert all(st[m].load_failures == 0 for m in (HOST, DISK))
    finally:
        core.close()
