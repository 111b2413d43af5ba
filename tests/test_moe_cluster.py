"""A mixture of experts served disaggregated: a Mixtral checkpoint (``hf_models.MOE_ARCHS``'
``mixtral``: 4 experts, top-2) through one prefill and two decode workers (real router, worker
processes, NIXL KV transfer), with the engine alone's greedy tokens (``kvrelay.engine.llm.LLM``,
itself held to transformers in tests/test_moe_models.py) for prompts within one block and
across several; a decode worker killed mid-stream, the stream resumed on the other with the
same tokens; and a TP=2 decode worker (each rank a slice of every expert) fed by the TP=1
prefill worker. One cluster for the module: the tests run in order, each leaving it as the next
one needs."""

from __future__ import annotations

import pytest
from cluster import Cluster, engine_alone, prompt_ids
from test_gemma3_cluster import replace_decode_workers_with_tp2

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM

pytestmark = pytest.mark.slow

MODEL = "mixtral"
LENGTHS = (5, 17, 130, 300)  # blocks of 16: within one, two, and 9 and 19 of them
GEN = 12


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> str:
    return hf_model_dir(MODEL)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with Cluster(model_dir, tmp_path_factory.mktemp("moe"), prefill=1, decode=2) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_blocks=256)


def check_greedy(cluster: Cluster, llm: LLM, what: str) -> None:
    """Every prompt length's greedy tokens through the cluster equal the engine alone's, its KV
    prefilled by the prefill worker and received by the decode worker; every block comes
    back."""
    baseline = cluster.free_blocks()
    with cluster.client() as c:
        for i, n in enumerate(LENGTHS):
            ids = prompt_ids(n, i)
            got = c.generate(ids, sampling(GEN, 0.0, ignore_eos=True))
            assert got.finish_reason == "length"
            assert got.token_ids == engine_alone(llm, ids, GEN), f"{what}, prompt of {n}"
            names = [e.name for e in got.trace]
            assert "received" in names and "prefill_end" in names, names
    assert cluster.wait_free_blocks(baseline) == baseline


def test_moe_greedy_through_one_prefill_and_one_decode_worker(cluster, llm) -> None:
    check_greedy(cluster, llm, "1P1D")


def test_moe_stream_survives_a_decode_worker_kill(cluster, llm) -> None:
    """The other decode worker recomputes the prompt's and the tokens' KV (fp32: the same
    values) and goes on with the engine alone's tokens."""
    n = 120
    ids = prompt_ids(90, 7)
    ref = engine_alone(llm, ids, n)
    killed = cluster.stream_killing_its_decode_worker(ids, n)
    got = killed.tokens
    assert got == ref


def test_moe_kv_from_a_tp1_prefill_worker_to_a_tp2_decode_worker(cluster, llm) -> None:
    """The surviving TP=1 decode worker stopped and a TP=2 one started: every request's KV goes
    from the TP=1 prefill worker to the two ranks, each of which holds half of every expert."""
    replace_decode_workers_with_tp2(cluster)
    check_greedy(cluster, llm, "TP=1 prefill -> TP=2 decode")
