"""Disaggregated serving over real processes and real NIXL: router, prefill and decode workers.

Greedy output through P -> NIXL -> D equals the engine alone and transformers; concurrency;
cancellation at every phase returns every KV block on both workers; bad input is refused."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from cluster import Cluster
from hf_models import hf_greedy

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LENGTHS = (1, 5, 16, 17, 100, 513, 2100)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    with Cluster(demo_model_dir, tmp_path_factory.mktemp("pd"), prefill=1, decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, num_blocks=1024)


def engine_alone(llm: LLM, ids: list[int], n: int) -> list[int]:
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return llm.generate(ids, sp)[0].token_ids


def test_greedy_identical_to_engine_and_transformers(cluster, llm, demo_model_dir) -> None:
    baseline = cluster.free_blocks()
    with cluster.client() as c:
        for i, n in enumerate(LENGTHS):
            ids = prompt_ids(n, i)
            got = c.generate(ids, sampling(12, 0.0, ignore_eos=True))
            assert got.finish_reason == "length"
            want = engine_alone(llm, ids, 12)
            assert got.token_ids == want, f"prompt of {n} tokens"
            if n in (17, 513, 2100):
                assert want == hf_greedy(demo_model_dir, ids, 12).token_ids
            names = [e.name for e in got.trace]
            assert names[:4] == ["received", "reserved", "prefill_start", "prefill_end"]
    assert cluster.wait_free_blocks(baseline) == baseline


def test_32_concurrent_mixed_requests(cluster, llm) -> None:
    baseline = cluster.free_blocks()
    reqs = [(prompt_ids(random.Random(k).choice([3, 40, 300, 900]), 100 + k),
             random.Random(k).randint(4, 24)) for k in range(32)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        ids, n = reqs[k]
        try:
            with cluster.client() as c:
                results[k] = c.generate(ids, sampling(n, 0.0, ignore_eos=True)).token_ids
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    for k, (ids, n) in enumerate(reqs):
        assert results[k] == engine_alone(llm, ids, n), k
    assert cluster.wait_free_blocks(baseline) == baseline


def _cancel_after(cluster: Cluster, ids: list[int], max_tokens: int, *, delay: float | None,
                  after_messages: int | None) -> None:
    with cluster.client() as c:
        call = c.stream(ids, sampling(max_tokens, 0.0, ignore_eos=True))
        if delay is not None:
            threading.Timer(delay, call.cancel).start()
        got = 0
        try:
            for _ in call:
                got += 1
                if after_messages is not None and got >= after_messages:
                    call.cancel()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED


def test_cancel_mid_prefill_transfer_and_decode_returns_every_block(cluster) -> None:
    baseline = cluster.free_blocks()
    long_prompt = prompt_ids(2500, 7)
    # Mid-prefill / mid-transfer: cancel at spread-out moments of a long prompt's prefill.
    for delay in (0.0, 0.01, 0.03, 0.06, 0.1, 0.15, 0.25):
        _cancel_after(cluster, long_prompt, 50, delay=delay, after_messages=None)
    # Mid-decode: after a few streamed tokens.
    for k in (1, 3, 8):
        _cancel_after(cluster, prompt_ids(200, k), 200, delay=None, after_messages=k)
    assert cluster.wait_free_blocks(baseline) == baseline
    # and the cluster still serves
    with cluster.client() as c:
        assert c.generate("still serving", sampling(4)).usage.completion_tokens >= 1


def test_invalid_requests_are_refused_and_servers_keep_serving(cluster) -> None:
    with cluster.client() as c:
        cases = [
            (prompt_ids(5000, 1), sampling(4)),  # longer than the context (4096)
            ("", sampling(4)),
            ([], sampling(4)),
            ("hi", sampling(4, temperature=1000.0)),
            ("hi", sampling(4, top_p=1.5)),
            ("hi", sampling(4, top_k=-5)),
            ("hi", sampling(4, logprobs=100)),
            ([1, 2, 99999], sampling(4)),
        ]
        for prompt, sp in cases:
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, sp)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (prompt[:3], sp)
            assert len(e.value.details()) > 10
        with pytest.raises(grpc.RpcError) as e:
            c.generate("hi", sampling(4), request_id="bad id with spaces")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert c.generate("ok", sampling(3)).usage.completion_tokens >= 1


def test_deadline_ends_the_request_and_frees_blocks(cluster) -> None:
    baseline = cluster.free_blocks()
    with cluster.client() as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prompt_ids(50, 3), sampling(3000, 0.0, ignore_eos=True), timeout_ms=300)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 30
    assert cluster.wait_free_blocks(baseline) == baseline


@pytest.mark.parametrize("n_p,n_d", [(2, 2)])
def test_two_by_two_spreads_load_and_stays_correct(demo_model_dir, tmp_path, llm, n_p, n_d):
    with Cluster(demo_model_dir, tmp_path, prefill=n_p, decode=n_d) as c:
        baseline = c.free_blocks()
        reqs = [(prompt_ids(60 + 40 * k, 200 + k), 10) for k in range(12)]
        out: dict[int, object] = {}

        def go(k: int) -> None:
            with c.client() as cl:
                out[k] = cl.generate(reqs[k][0], sampling(10, 0.0, ignore_eos=True))

        threads = [threading.Thread(target=go, args=(k,)) for k in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        used_p, used_d = set(), set()
        for k, (ids, n) in enumerate(reqs):
            r = out[k]
            assert r.token_ids == engine_alone(llm, ids, n)
            used_p |= {e.worker for e in r.trace if e.name == "prefill_end"}
            used_d |= {e.worker for e in r.trace if e.name == "reserved"}
        assert len(used_p) == n_p and len(used_d) == n_d
        assert c.wait_free_blocks(baseline) == baseline
