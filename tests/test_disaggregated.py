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
from kvrelay.common.failures import FailureKind, failure_of
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

pytestmark = pytest.mark.slow

LENGTHS = (1, 5, 16, 17, 100, 513, 2100)
LEASE_TTL_S = 120
SENDER_GRACE_S = 4  # the decode worker's --kv-sender-grace (10 s by default)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    # The Prefill-ahead hand-off here (Reserve-first is the default, tested everywhere else).
    # Leases outlive every wait below: blocks come back because someone ended their lease.
    # The KV goes whole at each step's end here (the harness's one-thread workers on unpinned
    # cores stream it layer by layer everywhere else: --kv-layerwise auto).
    with Cluster(demo_model_dir, tmp_path_factory.mktemp("pd"), prefill=1, decode=1,
                 router_args=("--prefill-ahead", "--lease-ttl", str(LEASE_TTL_S)),
                 worker_args=("--kv-sender-grace", str(SENDER_GRACE_S),
                              "--kv-layerwise", "off")) as c:
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
            assert names[:5] == ["received", "prefill_start", "reserved", "destination",
                                 "prefill_end"]
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
    refs = llm.generate([ids for ids, _ in reqs],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                         for _, n in reqs])
    for k, ref in enumerate(refs):
        assert results[k] == ref.token_ids, k
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
    """Blocks come back long before a lease could expire: whatever the moment of the cancel,
    the router released the lease (a Reserve whose answer was in flight, a Decode not yet at
    the worker) or the worker ended it."""
    baseline = cluster.free_blocks()
    long_prompt = prompt_ids(2500, 7)
    # Mid-reserve / mid-prefill / mid-transfer: cancel at spread-out moments of a long prompt.
    for delay in (0.0, 0.003, 0.006, 0.01, 0.015, 0.03, 0.06, 0.1, 0.15, 0.25):
        _cancel_after(cluster, long_prompt, 50, delay=delay, after_messages=None)
    # Between the first token (the Prefill's answer) and the Decode stream, and mid-decode.
    for seed, k in enumerate((1, 1, 1, 1, 3, 8)):
        _cancel_after(cluster, prompt_ids(200, seed), 200, delay=None, after_messages=k)
    assert cluster.wait_free_blocks(baseline, timeout=LEASE_TTL_S / 4) == baseline
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


def _reserve(d: worker_pb2_grpc.DecodeWorkerStub, rid: str, ids: list[int], sender: str,
             address: str) -> wpb.ReserveResponse:
    return d.Reserve(wpb.ReserveRequest(request_id=rid, prompt_token_ids=ids, ttl_ms=60_000,
                                        sender_agent=sender, sender_address=address),
                     timeout=10)


def test_blocks_given_up_before_their_kv_wait_until_the_sender_fenced_them(cluster) -> None:
    """Released before any KV came (and without the router vouching that nothing was sent),
    a lease's blocks are reused only once its sender has fenced it: after that, a Prefill for
    the lease that arrives late is refused without writing a byte."""
    baseline = cluster.free_blocks()
    decode, prefill = cluster.proc("decode-1"), cluster.proc("prefill-1")
    ids = prompt_ids(100, 3)
    with grpc.insecure_channel(decode.address) as dch, \
            grpc.insecure_channel(prefill.address) as pch:
        d = worker_pb2_grpc.DecodeWorkerStub(dch)
        lease = _reserve(d, "fence-1", ids, "prefill-1", prefill.address)
        assert cluster.free_blocks()["decode-1"] < baseline["decode-1"]
        assert d.Release(wpb.LeaseRequest(request_id="fence-1", lease_id=lease.lease_id),
                         timeout=10).ok
        assert cluster.wait_free_blocks(baseline) == baseline  # the sender said: nothing sent
        late = wpb.PrefillRequest(
            request_id="fence-1", prompt_token_ids=ids, sampling=sampling(1),
            dest=wpb.KVDestination(decode_address=decode.address, agent_name=lease.agent_name,
                                   incarnation=lease.incarnation, block_ids=lease.block_ids,
                                   skip_prefix_tokens=lease.cached_prefix_tokens,
                                   lease_id=lease.lease_id))
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.PrefillWorkerStub(pch).Prefill(late, timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert failure_of(e.value) == (FailureKind.FAILURE_LEASE_GIVEN_UP, True)


def test_blocks_promised_to_a_silent_sender_are_held_until_it_is_gone(cluster) -> None:
    """A sender that cannot be asked (unreachable) may still be writing: its blocks are not
    reused after a fixed couple of seconds, only once no router lists it (plus a grace)."""
    baseline = cluster.free_blocks()
    decode = cluster.proc("decode-1")
    with grpc.insecure_channel(decode.address) as dch:
        d = worker_pb2_grpc.DecodeWorkerStub(dch)
        lease = _reserve(d, "fence-2", prompt_ids(100, 4), "ghost", "127.0.0.1:9")
        d.Release(wpb.LeaseRequest(request_id="fence-2", lease_id=lease.lease_id), timeout=10)
        time.sleep(2.5)  # longer than the old fixed grace (2 s), shorter than ours
        assert cluster.free_blocks()["decode-1"] < baseline["decode-1"]
        # "ghost" is on no router's list: released after the connector's grace
        assert cluster.wait_free_blocks(baseline, timeout=30) == baseline

        # The router vouches that nothing was dispatched: reused at once, whoever the sender.
        lease = _reserve(d, "fence-3", prompt_ids(100, 5), "ghost", "127.0.0.1:9")
        d.Release(wpb.LeaseRequest(request_id="fence-3", lease_id=lease.lease_id,
                                   writes_settled=True), timeout=10)
        assert cluster.wait_free_blocks(baseline, timeout=3) == baseline  # < the grace
