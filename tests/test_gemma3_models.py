"""Gemma 3 (``Gemma3ForCausalLM``) against transformers, on tiny random checkpoints built by
transformers' own classes (``hf_models.GEMMA3_ARCHS``: GQA 2:1, 4:1 and 1:1, head dims 16 and
32, windows of 24, 8 and 40 tokens in several local:global patterns, linear rope scaling on the
global layers, final logit soft-capping, tied and untied embeddings): the config read and what
is refused, greedy tokens identical and logits within the fp32 bound (1e-4 of the range,
``test_engine_parity``) through chunks and decodes at a context past the window, chunked
prefill with a prefix-cache hit, a bf16 checkpoint within ``test_bf16_engine``'s bounds, and
TP=2."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from engine_runs import run_one
from hf_models import GEMMA3_ARCHS
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

from kvrelay.engine.hybrid_blocks import HybridBlockManager
from kvrelay.engine.models.arch import (
    UnsupportedModelError,
    load_hf_config,
    load_model_config,
    plain_config,
)
from kvrelay.engine.models.gemma3 import GLOBAL, LOCAL, Gemma3ForCausalLM, gemma3_ropes

GEMMA = sorted(GEMMA3_ARCHS)
# A prompt longer than every test checkpoint's window: the local layers' masks cut into the
# cached prefix when check_logits runs it in chunks.
PAST_WINDOW = 70
# What each checkpoint's ModelArch says: (windows, kv heads, head dim, query_pre_attn_scalar,
# final_logit_softcapping, tied).
EXPECTED = {
    "gemma3": ((24, 24, None), 2, 16, 16.0, None, True),
    "gemma3_mqa_scaled": ((8, None), 1, 32, 48.0, 5.0, False),
    "gemma3_mha": ((40, None, 40, 40), 4, 16, 64.0, None, True),
}


def _config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _write(d: Any, raw: dict[str, Any]) -> str:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


# -- the config -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GEMMA)
def test_arch_reads_gemma_fields_as_autoconfig_does(hf_model_dir, name: str) -> None:
    from transformers import AutoConfig

    d = hf_model_dir(name)
    assert plain_config(_config(d)) is None  # Gemma's defaults are its config class's code
    cfg, arch = load_model_config(d)
    assert type(cfg) is type(AutoConfig.from_pretrained(d, local_files_only=True))
    assert (arch.layer_windows, arch.num_kv_heads, arch.head_dim, arch.query_pre_attn_scalar,
            arch.final_logit_softcapping, arch.tie_word_embeddings) == EXPECTED[name]
    assert arch.family == "gemma3" and arch.qk_norm and not arch.is_moe


def test_legacy_rope_keys_give_the_same_tables(hf_model_dir, tmp_path) -> None:
    """A config as transformers 4 wrote it (``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling`` of the global layers, ``sliding_window_pattern``) reads to the same
    windows and rope tables as transformers 5's ``rope_parameters`` by layer type."""
    d = hf_model_dir("gemma3_mqa_scaled")
    raw = _config(d)
    legacy = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=2,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    old = load_hf_config(_write(tmp_path / "legacy", legacy))
    new = load_hf_config(d)
    _, arch = load_model_config(str(tmp_path / "legacy"))
    assert arch.layer_windows == (8, None)
    a, b = gemma3_ropes(old, 32), gemma3_ropes(new, 32)
    for kind in (LOCAL, GLOBAL):
        torch.testing.assert_close(a[kind][0], b[kind][0], rtol=0, atol=0)
        assert a[kind][1] == b[kind][1]
    assert not torch.equal(a[LOCAL][0], a[GLOBAL][0])  # two tables indeed


def test_what_is_not_implemented_is_refused_by_name(hf_model_dir, tmp_path) -> None:
    saved = _config(hf_model_dir("gemma3"))
    cases = [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]},
         r"unsupported architecture.*Gemma3ForConditionalGeneration.*Gemma3ForCausalLM"),
    ]
    for i, (change, match) in enumerate(cases):
        with pytest.raises(UnsupportedModelError, match=match):
            load_model_config(_write(tmp_path / str(i), {**saved, **change}))


# -- through the engine -----------------------------------------------------------------------
@pytest.mark.parametrize("name", GEMMA)
def test_greedy_tokens_and_logits_match_transformers(hf_model_dir, name: str) -> None:
    """A mixed batch's greedy tokens (prompts up to 70 tokens, generations of 24: past every
    window), then one prompt's logits through chunks and decodes."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir)
    model = core.runner.model
    assert isinstance(model, Gemma3ForCausalLM)
    assert model.fused_decode is None  # the native fused layer knows no Gemma norms: per op
    ps = prompts(1)
    free0 = core.block_manager.num_free_blocks
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    seen: set[int] = set()
    for i, p in enumerate(ps):
        ref = hf_tokens(model_dir, tuple(p), GEN)
        seen.update(ref)
        assert got[f"r{i}"] == ref, f"{name} prompt of {len(p)} tokens"
    assert len(seen) >= 10, "degenerate reference model"
    assert core.block_manager.num_free_blocks == free0
    check_logits(core, model_dir, tol=1e-4, length=PAST_WINDOW)


def test_torch_sdpa_backend_too(hf_model_dir) -> None:
    """The fallback where nothing native builds: windows through SDPA's masks."""
    model_dir = hf_model_dir("gemma3_mqa_scaled")
    core = make_core(model_dir, attention_backend="sdpa")
    assert core.runner.backend == "sdpa"
    check_logits(core, model_dir, tol=1e-4, length=PAST_WINDOW)


def test_chunked_prefill_with_a_prefix_cache_hit(hf_model_dir) -> None:
    model_dir = hf_model_dir("gemma3_mqa_scaled")  # window 8: the hit's blocks are mostly out
    core = make_core(model_dir)
    check_prefix_hit(core, model_dir)  # 24-token chunks over 40 cached tokens, past the window
    assert core.stats().prefix_cache_hits >= 40


@pytest.mark.parametrize("hybrid", ["off", "auto"])
def test_the_offline_llm_serves_gemma3(hf_model_dir, hybrid: str) -> None:
    from kvrelay.engine.llm import LLM

    model_dir = hf_model_dir("gemma3")
    ids = prompts(1)[-1]  # the mixed batch's longest (its reference is computed once)
    out = LLM(model_dir, num_blocks=64, block_size=8, hybrid_kv=hybrid).generate([ids],
                                                                                GREEDY)[0]
    assert out.token_ids == hf_tokens(model_dir, tuple(ids), GEN)


@pytest.mark.parametrize("name", ["gemma3_mqa_scaled"])
def test_bf16_checkpoint_within_the_stated_tolerance(hf_model_dir, name: str) -> None:
    """Logits within 2 % of the range of transformers in fp32 over the same weights with a bf16
    KV cache, 1e-4 with an fp32 one (``test_bf16_engine``'s bounds). Measured: 0.5 % with the
    bf16 cache (``gemma3_mha``: 1.1 %); ``gemma3`` (not here) is 5 %: its tied embedding of std
    0.03 gives logits of a tiny range that the cache's rounding moves by more (with an fp32
    cache it is within 3e-6, so the rounding is the cache's, not the model's)."""
    d = hf_model_dir(name, dtype=torch.bfloat16)
    for kv, tol in (("auto", BF16_KV_TOL), ("float32", FP32_TOL)):
        core = make_core(d, kv_cache_dtype=kv)
        assert core.runner.dtype == torch.bfloat16
        check_logits(core, d, tol=tol, length=40)


# -- tensor parallelism -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("hybrid", ["off", "auto"])
def test_tp2_matches_transformers(hf_model_dir, hybrid: str) -> None:
    """TP=2 on CPU (gloo): each rank holds half the heads (of the one KV head: a copy) and half
    the GeGLU; greedy tokens identical and logits within 1e-4, as at TP=1 (with the hybrid KV
    layout too: every rank gets each layer group's page tables)."""
    model_dir = hf_model_dir("gemma3")
    core = make_core(model_dir, tensor_parallel_size=2, tp_timeout_s=20.0, hybrid_kv=hybrid)
    try:
        layer = core.runner.model.layers[0]
        assert layer.attn.num_heads == 2 and layer.mlp.inter == 48
        ps = prompts(1, (7, 33))
        got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN), len(p)
        check_logits(core, model_dir, tol=1e-4, length=PAST_WINDOW)
    finally:
        core.runner.close()


# -- the hybrid KV layout (engine/hybrid_kv.py) -------------------------------------------------
def window_pages_bound(core: Any, seq: Any) -> int:
    """The most pages ``seq`` may hold under the hybrid layout: a page per block in each full
    group, ``ceil(w / bs) + 1`` in each group of window ``w``."""
    bm = core.block_manager
    bs = bm.block_size
    return sum(len(seq.block_table) if w is None else -(-w // bs) + 1
               for w in bm.groups.windows)


def check_hybrid_decode(core: Any, model_dir: str, length: int = PAST_WINDOW) -> None:
    """One prompt past the window under ``hybrid_kv="auto"``: greedy tokens equal to
    transformers', and after every step its windowed groups hold no more than their window's
    pages (its full groups every block)."""
    bm = core.block_manager
    assert isinstance(bm, HybridBlockManager)
    prompt = prompts(5, (length,))[0]
    free = bm.num_free_pages
    core.add_request("h", prompt, GREEDY)
    seq = core.seqs["h"]
    toks: list[int] = []
    while core.has_unfinished():
        for o in core.step():
            toks += o.new_token_ids
        if not seq.is_finished and seq.block_table:
            assert bm.held_pages(seq) <= window_pages_bound(core, seq)
    assert toks == hf_tokens(model_dir, tuple(prompt), GEN)
    assert bm.num_released_pages > 0
    assert bm.num_free_pages == free  # every page back (cached ones count as free)


def check_follow_up_turn(core: Any, model_dir: str) -> None:
    """A follow-up turn (the prompt, the answer, new tokens) under the hybrid layout finds the
    whole conversation cached: the answer's last decode still held its windows' pages. A
    prompt that branches off inside the first prompt gets a shorter hit (the windowed pages
    there went back) and the same tokens."""
    base = prompts(3, (41,))[0]
    answer = run(core, {"a": (base, GREEDY)})["a"]
    bs = core.block_manager.block_size
    for name, ids, least in (("turn", base + answer + prompts(4, (9,))[0],
                              (len(base) + len(answer) - 1) // bs * bs),
                             ("branch", base + prompts(4, (9,))[0], 0)):
        toks, cached = run_one(core, name, ids, GREEDY)
        assert cached >= least, name
        assert toks == hf_tokens(model_dir, tuple(ids), GEN), name


@pytest.mark.parametrize("name", GEMMA)
def test_hybrid_kv_matches_transformers_holding_the_windows(hf_model_dir, name: str) -> None:
    """``--hybrid-kv auto``: a page table per layer group; a mixed batch's greedy tokens, one
    prompt's logits through chunks and decodes, and a decode past the window that holds only
    the window in its local layers."""
    model_dir = hf_model_dir(name)
    core = make_core(model_dir, hybrid_kv="auto")
    plan = core.runner.kv_plan
    assert plan is not None and plan.num_groups > 1
    assert core.runner.kv.shape[:3] == (plan.k, 2, 256 * plan.num_groups)
    ps = prompts(1)
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN), f"{name} {len(p)}"
    check_logits(core, model_dir, tol=1e-4, length=PAST_WINDOW)
    check_hybrid_decode(core, model_dir)


def test_hybrid_kv_chunked_prefill_prefix_hits_and_sdpa(hf_model_dir) -> None:
    model_dir = hf_model_dir("gemma3_mqa_scaled")  # window 8 over blocks of 8
    for backend in ("auto", "sdpa"):
        core = make_core(model_dir, hybrid_kv="auto", attention_backend=backend)
        check_follow_up_turn(core, model_dir)
        check_hybrid_decode(core, model_dir)


def test_hybrid_kv_preemption_keeps_tokens_identical(hf_model_dir) -> None:
    """A pool too small for the batch: sequences are preempted (every group's pages back) and
    recomputed, and the tokens are still transformers'."""
    model_dir = hf_model_dir("gemma3")
    ps = prompts(5, (30, 25, 35, 20))
    core = make_core(model_dir, num_blocks=9, max_num_batched_tokens=64, hybrid_kv="auto")
    free = core.block_manager.num_free_pages
    got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    assert core.num_preemptions > 0
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN)
    assert core.block_manager.num_free_pages == free


def test_hybrid_kv_bf16_within_the_stated_tolerance(hf_model_dir) -> None:
    d = hf_model_dir("gemma3_mqa_scaled", dtype=torch.bfloat16)
    core = make_core(d, hybrid_kv="auto")
    check_logits(core, d, tol=BF16_KV_TOL, length=40)
    check_hybrid_decode(core, d)


def test_hybrid_kv_under_random_traffic_matches_one_table(hf_model_dir) -> None:
    """Requests arriving over time on a small pool (preemptions), follow-up turns over cached
    conversations (prefix hits across given-back pages), aborts: each request's greedy tokens
    with the hybrid layout equal one table's (an aborted one's: a prefix of the other's), and
    every page is back at the end."""
    import random

    model_dir = hf_model_dir("gemma3_mqa_scaled")  # window 8: pages go back every block
    rng = random.Random(7)
    plan: list[tuple[int, str, list[int] | None]] = []  # (step, request, prompt; None: abort)
    heads = [prompts(10 + i, (rng.randrange(10, 40),))[0] for i in range(3)]
    for i in range(14):
        ids = list(rng.choice(heads))
        ids += [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))]
        at = rng.randrange(0, 60)
        plan.append((at, f"q{i}", ids))
        if rng.random() < 0.2:
            plan.append((at + rng.randrange(2, 20), f"q{i}", None))
    plan.sort(key=lambda e: e[0])
    got: dict[str, dict[str, list[int]]] = {}
    for hybrid in ("off", "auto"):
        core = make_core(model_dir, num_blocks=16, max_num_batched_tokens=32, hybrid_kv=hybrid)
        out: dict[str, list[int]] = {}
        todo, step = list(plan), 0
        while todo or core.has_unfinished():
            while todo and todo[0][0] <= step:
                _, rid, ids = todo.pop(0)
                if ids is None:
                    core.abort(rid)
                else:
                    out[rid] = []
                    core.add_request(rid, ids, GREEDY)
            for o in core.step():
                out[o.request_id] += o.new_token_ids
            step += 1
        got[hybrid] = out
        if hybrid == "auto":
            bm = core.block_manager
            assert bm.num_free_pages == bm.num_pages and bm.num_released_pages > 0
            assert core.stats().prefix_cache_hits > 0 and core.num_preemptions > 0
    aborted = {rid for _, rid, ids in plan if ids is None}
    for rid, toks in got["off"].items():
        other = got["auto"][rid]
        if rid in aborted:
            n = min(len(toks), len(other))
            assert toks[:n] == other[:n], rid
        else:
            assert toks == other, rid


def test_hybrid_kv_host_tier_keeps_and_promotes_whole_blocks(hf_model_dir) -> None:
    """A host tier below the hybrid pool: a prompt's blocks reach the tier whole (copied down
    before their local pages go back), and once the pool has evicted them a second run of the
    prompt promotes them into fresh pages of every group; tokens transformers'."""
    from kvrelay.engine.tiers.media import HOST

    model_dir = hf_model_dir("gemma3_mqa_scaled")
    core = make_core(model_dir, hybrid_kv="auto", num_blocks=16, kv_offload_memory="1MiB")
    try:
        a = prompts(3, (41,))[0]
        want = hf_tokens(model_dir, tuple(a), GEN)
        assert run(core, {"a": (a, GREEDY)})["a"] == want
        for i, p in enumerate(prompts(6, (60, 60, 60))):
            run(core, {f"o{i}": (p, GREEDY)})
        assert not core.block_manager.match_prefix(a, 40).num_blocks  # evicted from the pool
        toks, cached = run_one(core, "again", a, GREEDY)
        assert toks == want and cached == 40
        assert core.stats().kv_tiers[HOST].hit_blocks == 5
    finally:
        core.close()


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_hybrid_kv_static_decode_matches_eager(hf_model_dir, backend: str) -> None:
    """The CUDA-graph decode path under the hybrid layout (static buffers per layer group, a
    windowed group's tables cut to its window, padding rows writing a scratch page per group),
    run eagerly on the CPU as ``test_cuda_graphs`` runs it: the eager step's logits, over
    sequences that gave pages back behind the window."""
    import random

    from kvrelay.engine.cuda.graphs import DecodeGraphRunner
    from kvrelay.engine.kv_connector import ScheduledSeq
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.sequence import Sequence

    model_dir = hf_model_dir("gemma3_mqa_scaled")  # window 8
    core = make_core(model_dir, hybrid_kv="auto", attention_backend=backend, num_blocks=64)
    runner = core.runner
    plan = runner.kv_plan
    bs = runner.block_size
    pages = runner.kv_spec.num_blocks
    # As a graphed runner does: the block manager never hands out the scratch pages.
    bm = HybridBlockManager(pages - plan.num_groups, bs, plan, False)
    static = runner.static_decode(8)
    assert isinstance(static, DecodeGraphRunner)
    assert [s for _, _, s in static.groups] == list(range(pages - plan.num_groups, pages))
    assert [w for _, w, _ in static.groups] == [-(-runner.max_model_len // bs), 8 // bs + 1]
    rng = random.Random(0)
    seqs = []
    for i, n in enumerate((3, 17, 40, 16, 33, 5, 1)):
        s = Sequence(f"s{i}", [rng.randrange(3, 250) for _ in range(n + 12)], SamplingParams())
        assert bm.allocate(s, s.num_tokens)
        if n > 1:
            runner.logits_for([ScheduledSeq(s, n)])
        s.num_computed_tokens = n
        bm.release_out_of_window(s)
        seqs.append(s)
    kv = runner.kv
    padded = False
    for _ in range(8):
        batch = rng.sample(seqs, rng.randrange(1, 8))
        sched = [ScheduledSeq(s, 1) for s in batch]
        kv[:, :, pages - plan.num_groups:] = 0
        got = static.logits(sched).clone()
        if len(batch) not in static.sizes:  # the padding rows wrote their scratch pages only
            padded = True
            assert kv[:, :, pages - plan.num_groups:].abs().sum() > 0
        eager = runner.logits_for(sched)
        order = sorted(range(len(batch)), key=lambda j: batch[j].num_computed_tokens)
        want = torch.empty_like(eager)
        want[torch.tensor(order)] = eager
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for s in batch:
            s.num_computed_tokens += 1
            bm.release_out_of_window(s)
    assert padded and bm.num_released_pages > 0
