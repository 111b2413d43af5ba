"""DeepSeek-V3 served disaggregated: a tiny DeepSeek-V3 (``hf_models.DEEPSEEK_ARCHS``'
``deepseek_v3``: latent attention, sigmoid-gated experts with shared ones, a dense first layer)
through one prefill and two decode workers (real router, worker processes, NIXL KV transfer of
the latent layout: one plane of ``kv_lora_rank + qk_rope_head_dim`` per token per layer), with
the engine alone's greedy tokens (``kvrelay.engine.llm.LLM``, itself held to transformers in
tests/test_deepseek_models.py) and exactly the latent bytes moved; a decode worker killed
mid-stream, the stream resumes on the other with the same tokens; a conversation's second turn
pulls its history's latents from the decode worker that generated it (P<-D, NIXL READ of the
one-plane layout) instead of recomputing them; then a TP=2 decode worker
(half the query heads per rank, the whole latent on each) receives the TP=1 prefill worker's
latents, each rank all of them. One cluster for the module: the tests run in order."""

from __future__ import annotations

import re
import urllib.request

import pytest
from cluster import Cluster, engine_alone, prompt_ids
from test_gemma3_cluster import replace_decode_workers_with_tp2
from test_prefix_pull_cluster import BS, second_turn_pulls_from_the_decode_worker

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.models.arch import load_model_config

pytestmark = pytest.mark.slow

MODEL = "deepseek_v3"
BLOCK = 16  # the workers' block size
LENGTHS = (5, 40, 130)
GEN = 12


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> str:
    return hf_model_dir(MODEL)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with Cluster(model_dir, tmp_path_factory.mktemp("deepseek"), prefill=1, decode=2,
                 router_args=("--http-port", "0", "--prefix-pull", "always")) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_blocks=256)


def kv_bytes_sent(cluster: Cluster) -> float:
    port = cluster.router.ready["http_port"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(
        r"^kvrelay:kv_transfer_bytes_total(?:{[^}]*})? (\S+)$", body, re.MULTILINE))


def check_greedy(cluster: Cluster, llm: LLM, model_dir: str, lengths: tuple[int, ...],
                 seed: int) -> None:
    """Every prompt's greedy tokens through the cluster equal the engine alone's, its latent
    KV prefilled by the prefill worker and received by the decode worker (every rank of it);
    the bytes moved (the handoff's payload, as the prefill worker reports it: once, whatever
    the receiving ranks) are each prompt block's one latent plane per layer (40 fp32 a token);
    every block comes back."""
    _, arch = load_model_config(model_dir)
    assert arch.kv_planes == 1
    block_bytes = BLOCK * (arch.kv_lora_rank + arch.qk_rope_head_dim) * 4
    baseline = cluster.free_blocks()
    before = kv_bytes_sent(cluster)
    with cluster.client() as c:
        for i, n in enumerate(lengths):
            ids = prompt_ids(n, seed + i)
            got = c.generate(ids, sampling(GEN, 0.0, ignore_eos=True))
            assert got.finish_reason == "length"
            assert got.token_ids == engine_alone(llm, ids, GEN), f"prompt of {n}"
            names = [e.name for e in got.trace]
            assert "received" in names and "prefill_end" in names, names
    moved = kv_bytes_sent(cluster) - before
    assert moved == sum(-(-n // BLOCK) for n in lengths) * arch.num_layers * block_bytes
    assert cluster.wait_free_blocks(baseline) == baseline


def test_deepseek_greedy_through_1p1d_moving_only_the_latent(cluster, llm, model_dir) -> None:
    check_greedy(cluster, llm, model_dir, LENGTHS, 0)


def test_deepseek_turn_two_pulls_the_latent_history_from_the_decode_worker(cluster,
                                                                           llm) -> None:
    """The second turn (the first's prompt, its answer, a new question) finds the history's
    latents on the decode worker that generated the answer, and the prefill worker reads them
    (P<-D) rather than recomputing: it computes only what nobody held, and the tokens are the
    engine alone's (a latent read to the wrong place, or the second plane a K/V layout would
    expect, would change them)."""
    assert BLOCK == BS  # the pull module's arithmetic of what the decode worker holds
    second_turn_pulls_from_the_decode_worker(
        cluster, lambda ids, n: engine_alone(llm, ids, n), prompt_ids(150, 30),
        prompt_ids(20, 31))


def test_deepseek_stream_survives_a_decode_worker_kill(cluster, llm) -> None:
    """The other decode worker recomputes the prompt's and the tokens' latents (fp32: the same
    values) and goes on with the engine alone's tokens."""
    n = 60
    ids = prompt_ids(50, 7)
    ref = engine_alone(llm, ids, n)
    killed = cluster.stream_killing_its_decode_worker(ids, n)
    got = killed.tokens
    assert got == ref


def test_deepseek_latent_from_a_tp1_prefill_worker_to_a_tp2_decode_worker(cluster, llm,
                                                                          model_dir) -> None:
    """The surviving decode worker stopped and a TP=2 one started: each rank (half the query
    heads) receives every latent block, the whole latent being every rank's: rank 1's half of
    the heads reads its own copy, so the tokens hold only if it arrived."""
    replace_decode_workers_with_tp2(cluster)
    check_greedy(cluster, llm, model_dir, (23, 70), 20)
