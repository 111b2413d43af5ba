"""Gemma 3 served disaggregated: a tiny Gemma 3 (``hf_models.GEMMA3_ARCHS``' ``gemma3``: two
local layers of window 24 and a global one) through one prefill and two decode workers (real
router, worker processes, NIXL KV transfer), on one block table for every layer (``--hybrid-kv
off``; the default hybrid layout is tests/test_hybrid_cluster.py), with the engine alone's greedy
tokens
(``kvrelay.engine.llm.LLM``, itself held to transformers in tests/test_gemma3_models.py) for
prompts within the window and well past it. The handoff is windowed (``engine/kv_window.py``):
the bytes the router counts are exactly the blocks each layer reads from the handoff on, well
under a dense handoff's; the decode worker serves a windowed handoff's blocks as a cached prefix
only where no window reaches into the skipped ones (a prompt sharing the first prompt's head
and ending inside it, and one extending the whole of it, both get the engine alone's tokens);
a decode worker killed mid-stream, the stream resumes on the other with the same tokens; and a
TP=2 decode worker (one KV head per rank) receives the TP=1 prefill worker's windowed KV. One
cluster for the module: the tests run in order, each leaving it as the next one needs."""

from __future__ import annotations

import re
import signal
import time
import urllib.request

import pytest
from cluster import Cluster, engine_alone, prompt_ids
from test_disaggregated_tp import _rank_pids

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.models.arch import load_model_config

pytestmark = pytest.mark.slow

MODEL = "gemma3"
BLOCK = 16  # the workers' block size
LENGTHS = (5, 23, 70, 130)  # within the window (24), then 3 and 5 times it
GEN = 12


@pytest.fixture(scope="module")
def model_dir(hf_model_dir) -> str:
    return hf_model_dir(MODEL)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    # one block table for every layer (the default hybrid layout: test_hybrid_cluster)
    with Cluster(model_dir, tmp_path_factory.mktemp("gemma3"), prefill=1, decode=2,
                 worker_args=("--hybrid-kv", "off"), router_args=("--http-port", "0")) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_blocks=256)


def kv_bytes_sent(cluster: Cluster) -> float:
    port = cluster.router.ready["http_port"]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(
        r"^kvrelay:kv_transfer_bytes_total(?:{[^}]*})? (\S+)$", body, re.MULTILINE))


def windowed_bytes(windows: tuple[int | None, ...], prompt: int, block_bytes: int) -> int:
    """By the definition: each layer's K and V of the prompt blocks holding a key some decode
    step attends to (the token at position p sees (p - window, p])."""
    pairs = 0
    for w in windows:
        first = 0 if w is None else max(0, prompt - w + 1)
        pairs += -(-prompt // BLOCK) - first // BLOCK
    return 2 * pairs * block_bytes


def check_greedy(cluster: Cluster, llm: LLM, prompts: list[list[int]], what: str) -> None:
    baseline = cluster.free_blocks()
    with cluster.client() as c:
        for ids in prompts:
            got = c.generate(ids, sampling(GEN, 0.0, ignore_eos=True))
            assert got.finish_reason == "length"
            assert got.token_ids == engine_alone(llm, ids, GEN), f"{what}, prompt of {len(ids)}"
            names = [e.name for e in got.trace]
            assert "received" in names and "prefill_end" in names, names
    assert cluster.wait_free_blocks(baseline) == baseline


def replace_decode_workers_with_tp2(cluster: Cluster) -> None:
    """Stop every decode worker and start one of TP=2; return once the router lists only it."""
    for p in cluster.live("decode"):
        cluster.kill(p, signal.SIGTERM)
        assert cluster.wait_exit(p, 60) is not None
    tp = cluster.add_worker("decode", extra=("--tensor-parallel-size", "2"))
    assert len(_rank_pids(tp.popen.pid)) == 1  # rank 1 (rank 0 is the worker itself)
    deadline = time.monotonic() + 30
    while {w.info.worker_id for w in cluster.registered()
           if w.info.worker_id.startswith("decode")} != {tp.name}:
        assert time.monotonic() < deadline, "the stopped decode workers stay registered"
        time.sleep(0.1)


def test_gemma3_greedy_through_1p1d_moving_only_the_windows(cluster, llm, model_dir) -> None:
    _, arch = load_model_config(model_dir)
    block_bytes = BLOCK * arch.num_kv_heads * arch.head_dim * 4  # one plane of one block, fp32
    prompts = [prompt_ids(n, i) for i, n in enumerate(LENGTHS)]
    before = kv_bytes_sent(cluster)
    check_greedy(cluster, llm, prompts, "1P1D")
    moved = kv_bytes_sent(cluster) - before
    want = sum(windowed_bytes(arch.layer_windows, n, block_bytes) for n in LENGTHS)
    dense = sum(windowed_bytes((None,) * arch.num_layers, n, block_bytes) for n in LENGTHS)
    assert moved == want < dense, (moved, want, dense)


def test_a_windowed_handoff_is_a_cached_prefix_only_where_no_window_reads_its_holes(
        cluster, llm) -> None:
    """The second prompt shares the first's 96 tokens (6 blocks) and ends 5 tokens later, so its
    local layers read from position 78 on: blocks 4 and 5, which the first handoff skipped for
    them. Were the decode worker to match them as its cached prefix, the prefill worker would
    not send them and the decode would attend to holes (this fails without
    ``BlockManager.mark_holes``). The third extends the whole first prompt: its local layers
    read from position 137 on, which the first handoff sent, so its 8 full blocks may serve."""
    first = prompt_ids(130, 11)
    second = first[:96] + prompt_ids(5, 12)
    third = first + prompt_ids(30, 13)
    check_greedy(cluster, llm, [first, second, third], "a prefix of a windowed handoff")


def test_gemma3_stream_survives_a_decode_worker_kill(cluster, llm) -> None:
    """The other decode worker gets the prompt and the tokens so far from a new prefill (a
    windowed handoff of its own) and goes on with the engine alone's tokens."""
    n = 80
    ids = prompt_ids(90, 7)
    ref = engine_alone(llm, ids, n)
    killed = cluster.stream_killing_its_decode_worker(ids, n)
    got = killed.tokens
    assert got == ref


def test_gemma3_windowed_kv_from_a_tp1_prefill_worker_to_a_tp2_decode_worker(cluster,
                                                                            llm) -> None:
    """The surviving decode worker stopped and a TP=2 one started: each rank receives its KV
    head's blocks, each layer only those it reads."""
    replace_decode_workers_with_tp2(cluster)
    prompts = [prompt_ids(n, 20 + i) for i, n in enumerate((23, 130))]
    check_greedy(cluster, llm, prompts, "TP=1 prefill -> TP=2 decode")
