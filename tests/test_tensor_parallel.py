"""Tensor parallelism on CPU (gloo, one thread per rank): a TP=2 replica against transformers on
every supported architecture (greedy tokens identical, logits within 1e-4), GQA with fewer KV
heads than ranks, prefix-cache hits and preemption, and a killed or stuck rank failing the
replica with a clear error in bounded time."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
from hf_models import ARCHS, hf_forward_logits, hf_greedy
from test_engine_parity import (
    GEN,
    GREEDY,
    check_prefix_hit,
    hf_tokens,
    make_core,
    prompts,
    run,
)

from kvrelay.engine.engine_core import EngineCore
from kvrelay.engine.kv_connector import ScheduledSeq
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.tp_shard import (
    TensorParallelError,
    kv_head_range,
    local_kv_heads,
    validate_tp,
)

pytestmark = pytest.mark.slow

TP = 2
BLOCK_SIZE = 8
# Every architecture, and GQA with a single KV head (fewer than ranks: replicated).
CASES = sorted(ARCHS) + ["llama_kv1"]


def _model(hf_model_dir, case: str) -> str:
    if case == "llama_kv1":
        return hf_model_dir("llama", num_key_value_heads=1)
    return hf_model_dir(case)


def tp_core(model_dir: str, **kw: object) -> EngineCore:
    kw.setdefault("tp_timeout_s", 20.0)
    return make_core(model_dir, tensor_parallel_size=TP, **kw)


def test_head_split() -> None:
    from kvrelay.engine.models.arch import ModelArch

    def arch(heads: int, kv: int) -> ModelArch:
        return ModelArch("LlamaForCausalLM", "llama", 10, 64, 128, 1, heads, kv, 16, 1e-6, 64,
                         False, False, False, False, False, (None,), "x")

    a = arch(8, 2)
    assert [kv_head_range(a, r, 4) for r in range(4)] == [range(0, 1), range(0, 1),
                                                           range(1, 2), range(1, 2)]
    assert local_kv_heads(arch(8, 8), 4) == 2
    assert [kv_head_range(arch(8, 8), r, 4) for r in (0, 3)] == [range(0, 2), range(6, 8)]
    with pytest.raises(ValueError, match="attention heads"):
        validate_tp(arch(6, 2), 4)
    with pytest.raises(ValueError, match="KV heads"):
        validate_tp(arch(12, 3), 2)


@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_transformers(hf_model_dir, case: str) -> None:
    """Greedy tokens of a mixed batch, then logits through chunks and decodes, on one TP=2
    replica per architecture; every block back at the end."""
    model_dir = _model(hf_model_dir, case)
    core = tp_core(model_dir)
    try:
        runner, bm = core.runner, core.block_manager
        assert runner.kv_spec.num_kv_heads == max(1, runner.arch.num_kv_heads // TP)
        free0 = bm.num_free_blocks
        ps = prompts(1)
        got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN), f"{case} len {len(p)}"
        assert bm.num_free_blocks == free0

        prompt = prompts(2, (70,))[0]
        ref = hf_greedy(model_dir, prompt, 8)
        ref_prefill = hf_forward_logits(model_dir, prompt)
        seq = Sequence("x", prompt + ref.token_ids, GREEDY)
        seq.num_prompt_tokens = len(prompt)
        assert bm.allocate(seq, seq.num_tokens)
        chunks = []
        for start, stop in ((0, 24), (24, 48), (48, 70)):
            chunks.append(runner.logits_for([ScheduledSeq(seq, stop - start)]))
            seq.num_computed_tokens = stop
        dec = []
        for _ in ref.token_ids[:-1]:
            dec.append(runner.logits_for([ScheduledSeq(seq, 1)])[0])
            seq.num_computed_tokens += 1
        err = (torch.cat(chunks) - ref_prefill).abs().max() / ref_prefill.abs().max()
        assert err < 1e-4, (case, float(err))
        ref_dec = ref.logits[1:]
        err = (torch.stack(dec) - ref_dec).abs().max() / ref_dec.abs().max()
        assert err < 1e-4, (case, float(err))
        bm.free(seq)
        assert bm.num_free_blocks == free0
    finally:
        core.runner.close()


def test_tp2_prefix_cache_hits(hf_model_dir) -> None:
    model_dir = hf_model_dir("qwen3")
    core = tp_core(model_dir)
    try:
        check_prefix_hit(core, model_dir)
    finally:
        core.runner.close()


def test_tp2_prompt_logprobs_over_chunks_match_transformers(hf_model_dir) -> None:
    """Prompt logprobs under TP: rank 0 reads them off every row of each prefill chunk (TP
    ranks run every row), equal to transformers' log-softmax of the same prompt."""
    from kvrelay.engine.sampling_params import SamplingParams

    model_dir = hf_model_dir("llama")
    ids = prompts(9, (40,))[0]
    core = tp_core(model_dir, max_num_batched_tokens=16)  # three chunks
    try:
        core.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                                                  prompt_logprobs=2))
        got = None
        while core.has_unfinished():
            for o in core.step():
                got = o.prompt_logprobs if o.prompt_logprobs is not None else got
    finally:
        core.runner.close()
    ref = torch.log_softmax(hf_forward_logits(model_dir, ids).float(), dim=-1)
    assert got is not None and [lp.token_id for lp in got] == ids[1:]
    want = [float(ref[i, t]) for i, t in enumerate(ids[1:])]
    assert [lp.logprob for lp in got] == pytest.approx(want, abs=1e-4)
    assert [lp.top[0][0] for lp in got] == ref[:len(ids) - 1].argmax(-1).tolist()


def test_tp2_preemption(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama", num_key_value_heads=1)
    ps = prompts(5, (30, 25, 35, 20))
    core = tp_core(model_dir, num_blocks=14, max_num_batched_tokens=64,
                   enable_prefix_caching=False)
    try:
        got = run(core, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
        assert core.num_preemptions > 0
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == hf_tokens(model_dir, tuple(p), GEN)
        assert core.block_manager.num_free_blocks == 14
    finally:
        core.runner.close()


def test_tp_size_that_does_not_divide_the_heads_is_refused(hf_model_dir) -> None:
    with pytest.raises(ValueError, match="must divide the 4 attention heads"):
        make_core(hf_model_dir("llama"), tensor_parallel_size=3)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stuck"])
def test_a_dead_or_stuck_rank_fails_the_replica_in_bounded_time(hf_model_dir, sig) -> None:
    timeout = 1.5  # a healthy step of this model takes milliseconds
    core = tp_core(hf_model_dir("llama"), tp_timeout_s=timeout)
    pid = core.runner.worker_pids[0]
    try:
        run(core, {"warm": (prompts(8, (12,))[0], GREEDY)})
        os.kill(pid, sig)
        core.add_request("a", prompts(9, (20,))[0], GREEDY)
        t = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor-parallel replica of 2 ranks"):
            for _ in range(100):
                core.step()
        assert time.monotonic() - t < 2 * timeout + 5
        with pytest.raises(TensorParallelError):  # stays failed, fails at once
            core.step()
    finally:
        if sig == signal.SIGSTOP:  # the replica's close() may have reaped it already
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        core.runner.close()


def test_serve_places_one_bundle_per_rank(hf_model_dir) -> None:
    """``kvrelay serve --both-tp 2``: a STRICT_PACK placement group of two per-rank bundles (one
    of both ranks' with GPUs) and
    an engine of two ranks; prefill/decode pools of TP sizes of their own, on CPUs and GPUs (each
    rank moves its own KV: ``kv_transfer/rank_agents.py``)."""
    pytest.importorskip("ray")
    from kvrelay.cli import build_parser
    from kvrelay.deploy.ray_cli import build_spec
    from kvrelay.deploy.spec import PoolSpec

    def args(*extra: str) -> object:
        return build_parser().parse_args([
            "serve", "--model", hf_model_dir("llama"), "--grpc-port", "0", "--control-port", "0",
            "--http-port", "-1", "--cpus-per-replica", "1", *extra])

    spec = build_spec(args("--both", "1", "--both-tp", "2"), loopback=True)
    both = spec.pools["both"]
    assert both.tp == 2 and both.strategy == "STRICT_PACK"
    assert both.bundles() == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert PoolSpec(1, 2.0).bundles() == [{"CPU": 2.0}] and PoolSpec(1).strategy == "PACK"
    # With GPUs a replica is one bundle of every rank's: its actor asks for all of its GPUs,
    # since Ray shows an actor (and its rank processes) only the GPUs it was given.
    gpu_tp = PoolSpec(1, 2.0, gpus=1.0, tp=2)
    assert gpu_tp.bundles() == [{"CPU": 4.0, "GPU": 2.0}] and gpu_tp.actor_gpus == 2.0
    assert PoolSpec(1, 2.0, gpus=1.0).bundles() == [{"CPU": 2.0, "GPU": 1.0}]
    # Prefill/decode pools of different TP sizes, on CPUs and on GPUs.
    pd = build_spec(args("--prefill", "1", "--prefill-tp", "2", "--decode", "1", "--decode-tp",
                         "1"), loopback=True)
    assert (pd.pools["prefill"].tp, pd.pools["decode"].tp) == (2, 1)
    assert pd.pools["prefill"].strategy == "STRICT_PACK"
    gpu = build_spec(args("--prefill", "1", "--decode", "1", "--decode-tp", "2", "--device",
                          "cuda"), loopback=True)
    # On GPUs the KV is heads first: any split moves a run of heads per block, no groups.
    assert gpu.pools["decode"].tp == 2 and gpu.kv_head_groups("prefill", 4) == 1
    assert pd.kv_head_groups("decode", 4) == 2  # on CPUs the TP=1 pool takes the ratio


def test_llm_and_cli_take_a_tensor_parallel_size(hf_model_dir) -> None:
    from kvrelay.cli import build_parser, engine_config_from_args
    from kvrelay.engine.llm import LLM

    model_dir = hf_model_dir("llama_tied")
    args = build_parser().parse_args(["worker", "--model", model_dir, "--role", "both",
                                      "--tensor-parallel-size", "2", "--tp-timeout-s", "9"])
    mc = engine_config_from_args(args).model
    assert (mc.tensor_parallel_size, mc.tp_timeout_s) == (2, 9.0)
    ids = prompts(11, (19,))[0]
    llm = LLM(model_dir, tensor_parallel_size=2, num_blocks=64, block_size=BLOCK_SIZE)
    try:
        out = llm.generate([ids], GREEDY)[0]
        assert out.token_ids == hf_tokens(model_dir, tuple(ids), GEN)
    finally:
        llm.engine.runner.close()
