"""Pull instead of recompute, end to end (real processes on loopback, real NIXL): a prefill
worker reads the prompt's prefix from the worker that holds more of it, the decode worker that
generated the previous turn (P<-D) or the other prefill worker (P<-P), computes only the rest,
and serves the engine alone's greedy tokens. A dead holder falls back to recomputing (counted),
a prompt under another cache salt pulls nothing, and every block comes back on every worker.

The router runs ``--prefix-pull always`` (the mechanism, whatever this host's crossover) and
round-robin prefill routing, so consecutive requests alternate between the two prefill
workers: a prompt's second request lands on the worker that did not compute it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import grpc
import httpx
import pytest
from cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import generate_pb2 as pb
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

pytestmark = pytest.mark.slow

BS = 16  # the workers' block size (the default)
N = 300
BEATS_S = 1.0  # three heartbeats: the router has seen what the last request left cached


def prompt_ids(seed: int, n: int = N) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    with Cluster(demo_model_dir, tmp_path_factory.mktemp("pull"), prefill=2, decode=1,
                 router_args=("--http-port", "0", "--policy", "round_robin",
                              "--prefix-pull", "always")) as c:
        yield c


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, num_blocks=256)


def alone(llm: LLM, ids: list[int], n: int) -> list[int]:
    return llm.generate(ids, SamplingParams(max_tokens=n, temperature=0,
                                            ignore_eos=True))[0].token_ids


def metrics(c: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{c.http_url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(m: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lv), v in m.items() if n == name and want <= set(lv))


def salted(c, ids: list[int], n: int, salt: str) -> list[int]:
    req = pb.GenerateRequest(sampling=sampling(n, 0.0, ignore_eos=True), cache_salt=salt)
    req.token_ids.ids.extend(ids)
    return [t for msg in c.stub.Generate(req, metadata=c.metadata, timeout=120)
            for t in msg.token_ids if not msg.index]


def prefilled_on(trace: list[pb.TraceEvent]) -> str:
    return next(e.worker for e in trace if e.name == "prefill_end")


def computed(m: dict) -> float:
    return total(m, "kvrelay:router_prompt_tokens_computed_total", pool="prefill")


def second_turn_pulls_from_the_decode_worker(cluster: Cluster,
                                             greedy: Callable[[list[int], int], list[int]],
                                             turn1: list[int], question: list[int]) -> None:
    """Turn one (``turn1``, 40 greedy tokens), then turn two (``turn1``, the answer,
    ``question``): its prefill worker pulls the history from the decode worker that generated
    it (P<-D) and computes only what nobody held; both turns' tokens are ``greedy``'s (the
    engine alone), and every block comes back."""
    baseline = cluster.free_blocks()
    with cluster.client() as c:
        answer = c.generate(turn1, sampling(40, 0.0, ignore_eos=True)).token_ids
        assert answer == greedy(turn1, 40)
        time.sleep(BEATS_S)  # the router has seen what the decode worker holds
        turn2 = turn1 + answer + question
        before = metrics(cluster)
        got = c.generate(turn2, sampling(8, 0.0, ignore_eos=True))
    after = metrics(cluster)
    assert got.token_ids == greedy(turn2, 8)
    held = (len(turn1) + len(answer) - 1) // BS * BS  # the decode worker's history
    assert total(after, "kvrelay:router_pull_decisions_total", decision="pull",
                 source_pool="decode") == \
        total(before, "kvrelay:router_pull_decisions_total", decision="pull",
              source_pool="decode") + 1
    assert total(after, "kvrelay:router_pull_outcomes_total", outcome="PULL_DONE") == \
        total(before, "kvrelay:router_pull_outcomes_total", outcome="PULL_DONE") + 1
    pulled = total(after, "kvrelay:router_pulled_tokens_total") - \
        total(before, "kvrelay:router_pulled_tokens_total")
    assert pulled >= held - len(turn1) // BS * BS, "at least the answer's blocks were pulled"
    # The prefill worker computed only what nobody held: the new question (and the history's
    # last partial block).
    assert computed(after) - computed(before) == len(turn2) - held
    assert got.usage.cached_prompt_tokens == held
    assert cluster.wait_free_blocks(baseline) == baseline


def test_turn_two_pulls_the_history_from_the_decode_worker(cluster, llm) -> None:
    second_turn_pulls_from_the_decode_worker(
        cluster, lambda ids, n: alone(llm, ids, n), prompt_ids(1), prompt_ids(2, 20))


def test_a_prefill_worker_pulls_a_prompt_the_other_one_computed(cluster, llm) -> None:
    baseline = cluster.free_blocks()
    doc = prompt_ids(3)
    with cluster.client() as c:
        c.generate(doc, sampling(1, 0.0, ignore_eos=True))  # one prefill worker computes it
        time.sleep(BEATS_S)
        ask = doc + prompt_ids(4, 24)
        before = metrics(cluster)
        got = c.generate(ask, sampling(8, 0.0, ignore_eos=True))  # on the other one
    after = metrics(cluster)
    assert got.token_ids == alone(llm, ask, 8)
    # Both the other prefill worker and the decode worker hold the document: the prefill
    # worker is preferred (lending takes nothing from a decode batch).
    assert total(after, "kvrelay:router_pull_decisions_total", decision="pull",
                 source_pool="prefill") == \
        total(before, "kvrelay:router_pull_decisions_total", decision="pull",
              source_pool="prefill") + 1
    assert total(after, "kvrelay:router_pull_outcomes_total", outcome="PULL_DONE") == \
        total(before, "kvrelay:router_pull_outcomes_total", outcome="PULL_DONE") + 1
    assert computed(after) - computed(before) == len(ask) - len(doc) // BS * BS
    assert cluster.wait_free_blocks(baseline) == baseline


def test_a_prompt_under_another_cache_salt_pulls_nothing(cluster, llm) -> None:
    baseline = cluster.free_blocks()
    doc = prompt_ids(5)
    with cluster.client() as c:
        salted(c, doc, 1, "alice")
        time.sleep(BEATS_S)
        ask = doc + prompt_ids(6, 24)
        before = metrics(cluster)
        got = salted(c, ask, 8, "bob")
    after = metrics(cluster)
    assert got == alone(llm, ask, 8)
    assert total(after, "kvrelay:router_pull_decisions_total") == \
        total(before, "kvrelay:router_pull_decisions_total"), "bob's chain is held nowhere"
    assert computed(after) - computed(before) == len(ask)
    # The holder itself exports nothing of the document under a salt it never saw, and all of
    # it under alice's (bob's request left it bob's chain too).
    d = cluster.live("decode")[0]
    with grpc.insecure_channel(d.address) as ch:
        stub = worker_pb2_grpc.WorkerControlStub(ch)
        for salt, want in (("carol", 0), ("alice", len(doc) // BS * BS)):
            e = stub.ExportPrefix(wpb.ExportPrefixRequest(share_id=f"t-{salt}",
                                                          prompt_token_ids=doc,
                                                          cache_salt=salt, ttl_ms=5000),
                                  metadata=cluster.metadata, timeout=10)
            assert e.tokens_covered == want, salt
            assert stub.EndExport(wpb.EndExportRequest(share_id=f"t-{salt}"),
                                  metadata=cluster.metadata, timeout=10).held == bool(want)
    assert cluster.wait_free_blocks(baseline) == baseline


def test_a_dead_holder_falls_back_to_recompute(cluster, llm) -> None:
    """The holder dies between the router's decision and the pull (the router still lists
    it): the prefill worker recomputes, the tokens are right, the fallback is counted."""
    doc = prompt_ids(7)
    with cluster.client() as c:
        first = c.generate(doc, sampling(1, 0.0, ignore_eos=True))
        time.sleep(BEATS_S)
        cluster.kill(cluster.proc(prefilled_on(first.trace)))
        baseline = cluster.free_blocks()
        ask = doc + prompt_ids(8, 24)
        before = metrics(cluster)
        t0 = time.monotonic()
        got = c.generate(ask, sampling(8, 0.0, ignore_eos=True))
        elapsed = time.monotonic() - t0
    after = metrics(cluster)
    assert got.token_ids == alone(llm, ask, 8)
    assert total(after, "kvrelay:router_pull_fallbacks_total") >= \
        total(before, "kvrelay:router_pull_fallbacks_total") + 1
    assert total(after, "kvrelay:router_pull_outcomes_total", outcome="PULL_SOURCE_FAILED") \
        >= total(before, "kvrelay:router_pull_outcomes_total", outcome="PULL_SOURCE_FAILED") + 1
    assert elapsed < 15, f"the fallback took {elapsed:.1f} s"
    assert cluster.wait_free_blocks(baseline) == baseline
    cluster.ensure_workers(prefill=2)
