"""Heads first inside a KV block (``--kv-layout heads``, the CUDA default): each head's tokens
together, so a peer of another tensor-parallel split moves a contiguous run of heads per block.

On the CPU the layout runs through torch SDPA (the native kernels read token-major blocks): the
engine computes exactly what it computes tokens first (greedy tokens and logprobs, chunked
prefill, prefix hits, copy-on-write forks, a sliding-window hybrid's pages, TP=2), the tensor is
stored heads first, and the settings that cannot hold it are refused with the flag to change.
The transport's side (one descriptor per run per block, P/D of other splits) is in
``test_kv_transfer_tp.py``; the cluster's in ``test_disaggregated_tp.py``.
"""

from __future__ import annotations

import random

import pytest

from kvrelay.engine.kv_cache import KVCacheSpec
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kv_transfer.layout import IncompatibleKVLayout, KVLayout, check_compatible

GEN = 10


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 120) for _ in range(n)]


def _run(model_dir: str, layout: str, **kw: object) -> tuple[list[list[int]], LLM]:
    """Prompts within a block, across blocks and chunked (16-token steps beside decodes), then
    the same prompts extended (prefix hits), then ``n=2`` forks (copy-on-write blocks)."""
    llm = LLM(model_dir, num_blocks=96, block_size=8, attention_backend="sdpa",
              max_num_batched_tokens=16, kv_layout=layout, **kw)
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [_prompt(n, 3 + i) for i, n in enumerate((6, 23, 40))]
    outs = llm.generate(prompts, sp)
    outs += llm.generate([p + [7, 9, 11] for p in prompts], sp)
    forks = llm.generate(prompts[1], SamplingParams(max_tokens=GEN, temperature=0.8, seed=5,
                                                    n=2, ignore_eos=True))
    got = [o.token_ids for o in outs] + [o.token_ids for o in forks]
    for o in outs:  # the logprob of each sampled token
        got.append([round(lp.logprob, 4) for lp in o.logprobs])
    return got, llm


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_heads_first_computes_what_tokens_first_does(hf_model_dir, arch: str) -> None:
    model_dir = hf_model_dir(arch)
    want, _ = _run(model_dir, "tokens")
    got, llm = _run(model_dir, "heads")
    assert got == want
    runner = llm.engine.runner
    spec = runner.kv_spec
    assert runner.heads_first and spec.heads_first
    # Stored [..., blocks, heads, block_size, head_dim]; layers read a strided block view.
    assert tuple(runner.kv.shape[-3:]) == (spec.num_kv_heads, spec.block_size, spec.head_dim)
    assert spec.groups is not None or arch == "llama"  # gemma3: the hybrid layout's pages
    cache = runner.model.layers[0].attn.k_cache
    assert cache.dim() == 4 and cache.data_ptr() == runner.kv[0, 0].data_ptr()


@pytest.mark.slow
def test_heads_first_under_tensor_parallelism(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama_mha")  # 4 KV heads: 2 per rank
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    prompts = [_prompt(n, 9 + i) for i, n in enumerate((6, 40))]
    want = [o.token_ids for o in LLM(model_dir, num_blocks=96, block_size=8,
                                     attention_backend="sdpa").generate(prompts, sp)]
    llm = LLM(model_dir, num_blocks=96, block_size=8, attention_backend="sdpa",
              kv_layout="heads", tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want
        assert llm.engine.runner.heads_first
    finally:
        llm.engine.runner.close()


def test_what_cannot_hold_heads_first_is_refused(hf_model_dir) -> None:
    model_dir = hf_model_dir("llama")
    with pytest.raises(ValueError, match="--attention-backend sdpa"):
        LLM(model_dir, num_blocks=32, attention_backend="native", kv_layout="heads")
    with pytest.raises(ValueError, match="--kv-head-groups"):
        LLM(model_dir, num_blocks=32, attention_backend="sdpa", kv_layout="heads",
            kv_head_groups=2)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        LLM(model_dir, num_blocks=32, kv_layout="sideways")
    # auto: tokens first on the CPU (what its native kernels read).
    assert not LLM(model_dir, num_blocks=32).engine.runner.heads_first


def test_a_peer_of_the_other_block_order_is_refused_naming_the_flag() -> None:
    spec = KVCacheSpec(2, 2, 8, 4, 16)
    heads = KVCacheSpec(2, 2, 8, 4, 16, heads_first=True)
    assert heads.shape == (2, 2, 16, 2, 4, 8) and spec.shape == (2, 2, 16, 4, 2, 8)
    assert heads.block_bytes == spec.block_bytes
    ours, theirs = KVLayout.from_spec(spec, "m"), KVLayout.from_spec(heads, "m")
    with pytest.raises(IncompatibleKVLayout, match="--kv-layout"):
        check_compatible(ours, theirs)
    assert KVLayout.from_bytes(theirs.to_bytes()) == theirs


def test_the_cli_takes_kv_layout(hf_model_dir) -> None:
    from kvrelay.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["worker", "--model", hf_model_dir("llama"), "--role",
                                      "decode", "--kv-layout", "heads"])
    assert engine_config_from_args(args).cache.kv_layout == "heads"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--model", "m", "--kv-layout", "sideways"])
