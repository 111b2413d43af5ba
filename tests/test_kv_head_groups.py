"""KV head groups (``--kv-head-groups G``): an engine (each rank, under TP) that keeps each group
of its KV heads in a tensor of its own, laid out as a rank of G times as many ranks lays out its
KV.

The engine computes exactly what it computes with one tensor (tokens and logprobs, through the
fused native decode layers, the per-op path, torch SDPA, chunked prefill, prefix hits and
copy-on-write of blocks), and it presents its groups to the KV transport as ranks: a prefill
replica of TP=G writes a decode engine of TP=1 in G groups rank to rank, with no repacking copy
(the cluster-level check is in ``test_disaggregated_tp.py``).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvrelay.engine.config import CacheConfig
from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kv_transfer.layout import KVLayout, head_runs
from kvrelay.kv_transfer.staging import needs_staging

GEN = 10


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 120) for _ in range(n)]


def _llm(model_dir: str, groups: int, backend: str) -> LLM:
    # Chunks of 16 tokens: prompts prefill over several steps beside running decodes.
    return LLM(model_dir, num_blocks=96, block_size=8, attention_backend=backend,
               max_num_batched_tokens=16, kv_head_groups=groups)


@pytest.mark.parametrize("backend", ["native", "sdpa"])
@pytest.mark.parametrize(("arch", "groups"),
                         [("llama", 2), ("llama_mha", 2), ("llama_mha", 4), ("llama_bias", 2)])
def test_grouped_cache_computes_what_one_tensor_does(hf_model_dir, arch: str, groups: int,
                                                     backend: str) -> None:
    model_dir = hf_model_dir(arch)
    prompts = [_prompt(n, i) for i, n in enumerate((5, 17, 70))]
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True, logprobs=2)
    one, grouped = _llm(model_dir, 1, backend), _llm(model_dir, groups, backend)
    runner = grouped.engine.runner
    assert runner.kv_groups == groups
    assert runner.kv.shape[0] == groups and runner.kv_spec.num_kv_heads * groups == \
        one.engine.runner.kv_spec.num_kv_heads
    if backend == "native":  # decode-only steps go through the fused layers, in groups
        assert runner.model.fused_decode is not None
    for _ in range(2):  # the second pass hits the prefix cache
        want, got = one.generate(prompts, sp), grouped.generate(prompts, sp)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids
            assert g.num_cached_tokens == w.num_cached_tokens
            for a, b in zip(w.logprobs, g.logprobs, strict=True):
                assert a is not None and b is not None
                assert abs(a.logprob - b.logprob) <= 1e-5
    assert got[2].num_cached_tokens > 0


def test_per_op_decode_in_groups(hf_model_dir, monkeypatch) -> None:
    """The per-op decode path (fused layers off) gives the same tokens in groups."""
    monkeypatch.setenv("KVRELAY_FUSED_DECODE", "0")
    model_dir = hf_model_dir("llama_mha")
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    prompts = [_prompt(n, 7 + i) for i, n in enumerate((9, 33))]
    grouped = _llm(model_dir, 2, "native")
    assert grouped.engine.runner.model.fused_decode is None
    want = [o.token_ids for o in _llm(model_dir, 1, "native").generate(prompts, sp)]
    assert [o.token_ids for o in grouped.generate(prompts, sp)] == want


def test_preemption_in_groups(hf_model_dir) -> None:
    """Too few blocks for every sequence: preempted ones recompute into their groups and end
    with the tokens of an engine that had room; every block comes back."""
    model_dir = hf_model_dir("llama_mha")
    prompts = [_prompt(n, 20 + i) for i, n in enumerate((30, 25, 35, 20))]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in _llm(model_dir, 1, "native").generate(prompts, sp)]
    tight = LLM(model_dir, num_blocks=14, block_size=8, max_num_batched_tokens=64,
                enable_prefix_caching=False, kv_head_groups=2)
    assert [o.token_ids for o in tight.generate(prompts, sp)] == want
    core = tight.engine
    assert core.num_preemptions > 0
    assert core.block_manager.num_free_blocks == core.runner.num_usable_blocks


def test_copy_on_write_copies_every_group(hf_model_dir) -> None:
    runner = _llm(hf_model_dir("llama_mha"), 2, "native").engine.runner
    kv = runner.kv
    kv.copy_(torch.randn(kv.shape))
    runner.copy_blocks([(3, 10), (4, 11)])
    for g in range(2):
        assert torch.equal(kv[g][:, :, 10], kv[g][:, :, 3])
        assert torch.equal(kv[g][:, :, 11], kv[g][:, :, 4])


def test_groups_are_the_transports_ranks(hf_model_dir) -> None:
    """What the KV connector registers: group 0's tensor, the others as ranks, each group's
    heads; a prefill replica of TP=2 then writes it rank to rank (no staging)."""
    runner = _llm(hf_model_dir("llama_mha"), 2, "native").engine.runner
    rk = runner.rank_kv
    assert rk is not None and rk.head_ranges == ((0, 2), (2, 4)) and rk.model_kv_heads == 4
    assert runner.transfer_kv.data_ptr() == runner.kv[0].data_ptr()
    assert [t.data_ptr() for t in rk.others] == [runner.kv[1].data_ptr()]
    ours = KVLayout.from_spec(runner.kv_spec, "m", head_ranges=rk.head_ranges,
                              model_kv_heads=rk.model_kv_heads)
    s = runner.kv_spec
    tp2 = KVLayout.from_spec(KVCacheSpec(s.num_layers, 2, s.head_dim, s.block_size, 40), "m",
                             head_ranges=((0, 2), (2, 4)), model_kv_heads=4)
    one = KVLayout.from_spec(KVCacheSpec(s.num_layers, 4, s.head_dim, s.block_size, 40), "m")
    assert not needs_staging(tp2, ours, head_runs(tp2, ours))
    assert not needs_staging(ours, tp2, head_runs(ours, tp2))
    assert needs_staging(tp2, one, head_runs(tp2, one))  # without groups: repacked


def test_bad_group_counts_are_refused(hf_model_dir) -> None:
    with pytest.raises(ValueError, match="kv_head_groups must be positive"):
        CacheConfig(kv_head_groups=0)
    with pytest.raises(ValueError, match="--kv-head-groups 3 must divide"):
        LLM(hf_model_dir("llama"), num_blocks=16, kv_head_groups=3)
    with pytest.raises(ValueError, match="--kv-head-groups 2 must divide the 1 KV heads"):
        LLM(hf_model_dir("llama"), num_blocks=16, kv_head_groups=2, tensor_parallel_size=2)


@pytest.mark.slow
def test_tensor_parallel_ranks_in_groups(hf_model_dir) -> None:
    """TP=2, each rank's two KV heads in two groups: the same tokens as one engine alone, and
    every rank's groups are the transport's ranks, rank 0 holding its own two (so a replica of
    TP=4 writes it rank to rank)."""
    model_dir = hf_model_dir("llama_mha")  # 4 KV heads
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    prompts = [_prompt(n, 3 + i) for i, n in enumerate((6, 40))]
    want = [o.token_ids for o in _llm(model_dir, 1, "native").generate(prompts, sp)]
    llm = LLM(model_dir, num_blocks=96, block_size=8, max_num_batched_tokens=16,
              tensor_parallel_size=2, kv_head_groups=2)
    try:
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
        runner = llm.engine.runner
        rk = runner.rank_kv
        assert rk.head_ranges == ((0, 1), (1, 2), (2, 3), (3, 4)) and len(rk.others) == 1
        assert rk.slots == (0, 1) and rk.services is not None
        assert runner.transfer_kv.data_ptr() == runner.kv[0].data_ptr()
        s = runner.kv_spec
        ours = KVLayout.from_spec(s, "m", head_ranges=rk.head_ranges, model_kv_heads=4)
        tp4 = KVLayout.from_spec(KVCacheSpec(s.num_layers, 1, s.head_dim, s.block_size, 40),
                                 "m", head_ranges=((0, 1), (1, 2), (2, 3), (3, 4)),
                                 model_kv_heads=4)
        assert not needs_staging(ours, tp4, head_runs(ours, tp4))
    finally:
        llm.engine.runner.close()


def test_the_cli_takes_kv_head_groups(hf_model_dir) -> None:
    import argparse

    from kvrelay.common.options import add_engine_options, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--model", hf_model_dir("llama"), "--kv-head-groups", "2"])
    assert engine_config_from_args(args).cache.kv_head_groups == 2


def test_serve_puts_the_tp1_pool_in_the_other_pools_groups(hf_model_dir) -> None:
    """``kvrelay serve --prefill-tp A --decode-tp B``: the TP=1 pool's engines keep their KV
    heads in the other pool's TP size of groups where it divides them; never a TP>1 pool."""
    pytest.importorskip("ray")
    from kvrelay.cli import build_parser
    from kvrelay.deploy.ray_cli import build_spec
    from kvrelay.deploy.spec import ServeSpec, model_kv_heads

    model_dir = hf_model_dir("llama_mha")  # 4 KV heads

    def spec(*extra: str) -> ServeSpec:
        return build_spec(build_parser().parse_args([
            "serve", "--model", model_dir, "--grpc-port", "0", "--control-port", "0",
            "--http-port", "-1", "--prefill", "1", "--decode", "1", *extra]), loopback=True)

    heads = model_kv_heads(model_dir)
    assert heads == 4 and model_kv_heads(str(model_dir) + "-missing") == 0

    def groups(s: ServeSpec) -> tuple[int, int]:
        return s.kv_head_groups("prefill", heads), s.kv_head_groups("decode", heads)

    assert groups(spec("--prefill-tp", "2")) == (1, 2)
    assert groups(spec("--decode-tp", "2")) == (2, 1)
    assert groups(spec("--decode-tp", "4")) == (4, 1)
    assert groups(spec("--prefill-tp", "2", "--decode-tp", "4")) == (2, 1)  # 2 heads a rank
    assert groups(spec("--prefill-tp", "4", "--decode-tp", "2")) == (1, 2)
    assert groups(spec("--prefill-tp", "2", "--decode-tp", "2")) == (1, 1)
    assert groups(spec()) == (1, 1)
    assert spec("--decode-tp", "2").kv_head_groups("prefill", 3) == 1  # 3 heads: no groups
    assert spec("--decode-tp", "2").kv_head_groups("prefill", 0) == 1  # unknown: none
    # Set by hand: on the pool of the smaller TP size (or both where they are equal).
    assert groups(spec("--decode-tp", "2", "--kv-head-groups", "4")) == (4, 1)


def test_a_peer_whose_writes_repack_is_named_in_the_log() -> None:
    from kvrelay.kv_transfer.staging import repack_note

    def layout(tp: int) -> KVLayout:
        spec = KVCacheSpec(2, 4 // tp, 8, 4, 10)
        return KVLayout.from_spec(spec, "m", head_ranges=tuple(
            (r * 4 // tp, (r + 1) * 4 // tp) for r in range(tp)), model_kv_heads=4)

    one, two, four = layout(1), layout(2), layout(4)
    assert repack_note(two, two, head_runs(two, two)) == ""
    assert repack_note(one, one, None) == ""
    note = repack_note(two, one, head_runs(two, one))
    assert "split 2 way(s), its 1" in note and "--kv-head-groups 2 on the side split 1" in note
    assert "--kv-head-groups 4" in repack_note(one, four, head_runs(one, four))
    note = repack_note(four, two, head_runs(four, two))
    assert "repacks" in note and "--kv-head-groups 2 on the side split 2 way(s)" in note


def test_the_k8s_tp_overlay_puts_decode_in_the_prefill_ranks_groups() -> None:
    """overlays/cpu-demo-tp: prefill pods of TP=2 and decode pods of TP=1 whose KV heads sit in
    two groups, the pairing serve would choose; the prefill ranks' KV fits the pod's /dev/shm."""
    from deploy_checks import pool_deployment, pool_proc, render

    from kvrelay.engine.config import parse_bytes

    docs = render("overlays/cpu-demo-tp")
    p, d = pool_proc(docs, "prefill").ns, pool_proc(docs, "decode").ns
    assert (int(p.tensor_parallel_size), int(p.kv_head_groups)) == (2, 1)
    assert (int(d.tensor_parallel_size), int(d.kv_head_groups)) == (1, 2)
    [shm] = [v for v in pool_deployment(docs, "prefill")["spec"]["template"]["spec"]["volumes"]
             if v["name"] == "dshm"]
    assert parse_bytes(shm["emptyDir"]["sizeLimit"].replace("Gi", "GiB")) >= \
        2 * parse_bytes(p.kv_cache_memory)
