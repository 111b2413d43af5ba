"""The hybrid KV layout (``--hybrid-kv auto``, ``engine/hybrid_kv.py``) served disaggregated: the
tiny Gemma 3 of tests/test_gemma3_cluster.py (two local layers of window 24, a global one) through
one prefill and two decode workers, every worker on the hybrid layout (real router, worker
processes, NIXL KV transfer). A decode worker's reservation holds, of each windowed layer group,
only the pages its first decode reads and names them; the prefill worker writes each group's
pages (``kv_window.PageWrites``). Greedy tokens are the engine alone's for prompts within the
window and well past it; the bytes moved are exactly those of the one-table layout's windowed
handoff (each layer, the blocks it reads); a follow-up turn reuses the decode worker's partial
blocks only where no window reads a page they lack; the next turn's prefill worker pulls the
history from the decode worker that generated it (P<-D, the pages a continuation reads); a
decode worker killed mid-stream, the stream goes on, same tokens, on the other; a TP=2 decode
worker receives from the TP=1 prefill worker; every page comes back."""

from __future__ import annotations

import pytest
from cluster import Cluster, engine_alone, prompt_ids
from test_gemma3_cluster import (
    LENGTHS,
    MODEL,
    check_greedy,
    kv_bytes_sent,
    replace_decode_workers_with_tp2,
    windowed_bytes,
)
from test_prefix_pull_cluster import BS, second_turn_pulls_from_the_decode_worker

from kvrelay.engine.llm import LLM
from kvrelay.engine.models.arch import load_model_config

pytestmark = pytest.mark.slow

BLOCK = 16  # the workers' block size (test_gemma3_cluster's)


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> str:
    return hf_model_dir(MODEL)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with Cluster(model_dir, tmp_path_factory.mktemp("hybrid"), prefill=1, decode=2,
                 worker_args=("--hybrid-kv", "auto"),
                 router_args=("--http-port", "0", "--prefix-pull", "always")) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_blocks=256)  # the one-table layout: the same tokens


def test_hybrid_greedy_through_1p1d_moving_only_the_windows(cluster, llm, model_dir) -> None:
    for p in cluster.workers:  # the engine's start-up line names the layout it runs
        assert "in 3 layer groups" in p.log.read_text(errors="replace"), p.tail()
    _, arch = load_model_config(model_dir)
    block_bytes = BLOCK * arch.num_kv_heads * arch.head_dim * 4  # one plane of one page, fp32
    prompts = [prompt_ids(n, 40 + i) for i, n in enumerate(LENGTHS)]
    before = kv_bytes_sent(cluster)
    check_greedy(cluster, llm, prompts, "1P1D, hybrid KV")
    moved = kv_bytes_sent(cluster) - before
    want = sum(windowed_bytes(arch.layer_windows, n, block_bytes) for n in LENGTHS)
    assert moved == want, (moved, want)


def test_a_follow_up_reuses_the_partial_handoff_only_where_no_window_reads_a_missing_page(
        cluster, llm) -> None:
    """As in test_gemma3_cluster: the second prompt ends inside the first's skipped pages (its
    local layers would read them), the third extends the whole first prompt."""
    first = prompt_ids(130, 51)
    second = first[:96] + prompt_ids(5, 52)
    third = first + prompt_ids(30, 53)
    check_greedy(cluster, llm, [first, second, third], "a prefix of a hybrid handoff")


def test_turn_two_pulls_the_pages_its_continuation_reads_from_the_decode_worker(
        cluster, llm) -> None:
    """P<-D under the hybrid layout (the router runs ``--prefix-pull always``): the decode
    worker that generated the answer kept each windowed group's pages of its last full block's
    window, exports that prefix with its pages, and the prefill worker reads the pages a
    continuation reads and computes only the rest; the engine alone's tokens."""
    assert BLOCK == BS
    second_turn_pulls_from_the_decode_worker(
        cluster, lambda ids, n: engine_alone(llm, ids, n), prompt_ids(150, 70),
        prompt_ids(20, 71))


def test_hybrid_stream_survives_a_decode_worker_kill(cluster, llm) -> None:
    n = 80
    ids = prompt_ids(90, 57)
    assert cluster.stream_killing_its_decode_worker(ids, n).tokens == engine_alone(llm, ids, n)


def test_hybrid_kv_from_a_tp1_prefill_worker_to_a_tp2_decode_worker(cluster, llm) -> None:
    """The decode workers stopped and a TP=2 one started (one KV head per rank, each rank's
    hybrid tensor registered by rank 0's agent): each rank receives its head of each group's
    pages."""
    replace_decode_workers_with_tp2(cluster)
    prompts = [prompt_ids(n, 60 + i) for i, n in enumerate((23, 130))]
    check_greedy(cluster, llm, prompts, "TP=1 prefill -> TP=2 decode, hybrid KV")
