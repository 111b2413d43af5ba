"""gpt-oss served disaggregated: a tiny gpt-oss (``hf_models.GPT_OSS_ARCHS``' ``gpt_oss``: 4
experts top-2, a sliding layer of window 16 and a full one, attention sinks) through one prefill
and two decode workers (real router, worker processes, NIXL KV transfer; the default hybrid KV
layout: a page table per layer group, ``engine/hybrid_kv.py``), with the engine
alone's greedy tokens (``kvrelay.engine.llm.LLM``, itself held to transformers in
tests/test_gpt_oss_models.py) for prompts within the window and well past it; a decode worker
killed mid-stream, the stream resumes on the other with the same tokens. One cluster for the
module: the tests run in order."""

from __future__ import annotations

import pytest
from cluster import Cluster, engine_alone, prompt_ids

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM

pytestmark = pytest.mark.slow

MODEL = "gpt_oss"
LENGTHS = (5, 17, 70, 130)  # within the window (16), then past it by 1, 4 and 8 windows
GEN = 12


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> str:
    return hf_model_dir(MODEL)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with Cluster(model_dir, tmp_path_factory.mktemp("gpt-oss"), prefill=1, decode=2) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_blocks=256)


def test_gpt_oss_greedy_through_one_prefill_and_one_decode_worker(cluster, llm) -> None:
    """Every prompt length's greedy tokens through the cluster equal the engine alone's, its KV
    prefilled by the prefill worker and received by the decode worker; every block comes
    back."""
    baseline = cluster.free_blocks()
    with cluster.client() as c:
        for i, n in enumerate(LENGTHS):
            ids = prompt_ids(n, i)
            got = c.generate(ids, sampling(GEN, 0.0, ignore_eos=True))
            assert got.finish_reason == "length"
            assert got.token_ids == engine_alone(llm, ids, GEN), f"prompt of {n}"
            names = [e.name for e in got.trace]
            assert "received" in names and "prefill_end" in names, names
    assert cluster.wait_free_blocks(baseline) == baseline


def test_gpt_oss_stream_survives_a_decode_worker_kill(cluster, llm) -> None:
    """The other decode worker recomputes the prompt's and the tokens' KV (fp32: the same
    values) and goes on with the engine alone's tokens."""
    n = 80
    ids = prompt_ids(60, 7)
    ref = engine_alone(llm, ids, n)
    killed = cluster.stream_killing_its_decode_worker(ids, n)
    got = killed.tokens
    assert got == ref
