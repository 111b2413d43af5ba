"""Disaggregated serving with tensor parallelism in the pools: a prefill worker of TP=A streams
its prompt KV to a decode worker of TP=B (real router, worker and rank processes, real NIXL).

For (A, B) in (2, 1), (1, 2), (2, 2): greedy tokens equal the engine alone and transformers, for
prompts within one block, across blocks and chunked; every KV block of both workers comes back.
"""

from __future__ import annotations

import random

import pytest
from cluster import Cluster
from hf_models import hf_greedy

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LENGTHS = (5, 17, 300)
GEN = 8


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def want(demo_model_dir) -> dict[int, list[int]]:
    """The engine alone (TP=1) per prompt length, checked against transformers."""
    llm = LLM(demo_model_dir, num_blocks=256)
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    out = {}
    for i, n in enumerate(LENGTHS):
        ids = prompt_ids(n, i)
        out[n] = llm.generate(ids, sp)[0].token_ids
        assert out[n] == hf_greedy(demo_model_dir, ids, GEN).token_ids
    return out


def _tp(n: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(n)) if n > 1 else ()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2)])
def test_greedy_identical_across_tp_sizes(demo_model_dir, tmp_path, want, p_tp: int,
                                          d_tp: int) -> None:
    with Cluster(demo_model_dir, tmp_path, prefill=0, decode=0,
                 worker_args=("--max-num-batched-tokens", "128")) as c:
        c.add_worker("prefill", extra=_tp(p_tp), wait=False)
        c.add_worker("decode", extra=_tp(d_tp), wait=False)
        for p in c.workers:
            c._wait_ready(p)
        c.wait_registered()
        baseline = c.free_blocks()
        with c.client() as cl:
            for i, n in enumerate(LENGTHS):
                got = cl.generate(prompt_ids(n, i), sampling(GEN, 0.0, ignore_eos=True))
                assert got.finish_reason == "length"
                assert got.token_ids == want[n], f"P={p_tp} D={d_tp}, prompt of {n} tokens"
                # The KV came from the prefill worker: the decode worker never prefilled it.
                names = [e.name for e in got.trace]
                assert "received" in names and "prefill_end" in names, names
        assert c.wait_free_blocks(baseline) == baseline
