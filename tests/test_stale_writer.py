"""No stale writer: a prefill worker that was stopped (SIGSTOP) while it held a lease's KV must not
write it into blocks its decode worker reused after the sender grace, once it runs again.

The wedged worker finished prefilling request A and waits for A's destination (Prefill-ahead);
it is frozen, and the destination is sent to it while frozen. A's decode lease is then given up:
its blocks are held for the sender until no router has listed it for the grace, then reused by
request B, which another prefill worker fills. Only then does the frozen worker resume and
read A's destination. Without self-fencing it writes A's KV into those blocks and B decodes
garbage; with it, the worker knows its proof of being listed ran out while it was stopped and
refuses: B's output equals the engine alone's, and every block comes back."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import grpc
import pytest
from cluster import Cluster

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

pytestmark = pytest.mark.slow

GRACE_S = 4.0  # --kv-sender-grace: self-fence 2 s, write timeout 1.6 s by default
PROMPT = 250  # 16 blocks of 16
DECODE_BLOCKS = 24  # B's 16 blocks must take 8 of A's: the free list is FIFO
MAX_TOKENS = 8


def prompt_ids(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(PROMPT)]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    with Cluster(demo_model_dir, tmp_path_factory.mktemp("stale"), prefill=2, decode=0,
                 worker_args=("--kv-sender-grace", str(GRACE_S))) as c:
        c.add_worker("decode", extra=("--num-kv-blocks", str(DECODE_BLOCKS)))
        yield c


def _dest(decode_address: str, lease: wpb.ReserveResponse) -> wpb.KVDestination:
    return wpb.KVDestination(decode_address=decode_address, agent_name=lease.agent_name,
                             incarnation=lease.incarnation, block_ids=lease.block_ids,
                             skip_prefix_tokens=lease.cached_prefix_tokens,
                             lease_id=lease.lease_id)


def _in_thread(fn, results: dict, key: str) -> threading.Thread:
    def run() -> None:
        try:
            results[key] = fn()
        except grpc.RpcError as e:
            results[key] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _free(cluster: Cluster, name: str) -> int:
    return cluster.status(cluster.proc(name)).load.free_blocks


def test_a_wedged_sender_never_writes_into_blocks_reused_after_the_grace(
        cluster, demo_model_dir) -> None:
    decode, p1, p2 = (cluster.proc(n) for n in ("decode-1", "prefill-1", "prefill-2"))
    baseline = cluster.free_blocks()
    a_ids, b_ids = prompt_ids(1), prompt_ids(2)
    results: dict = {}
    with grpc.insecure_channel(decode.address) as dch, \
            grpc.insecure_channel(p1.address) as p1ch, \
            grpc.insecure_channel(p2.address) as p2ch:
        d = worker_pb2_grpc.DecodeWorkerStub(dch)
        # A: promised to prefill-1 (no control address: nobody can ask it to fence).
        lease_a = d.Reserve(wpb.ReserveRequest(request_id="stale-a", prompt_token_ids=a_ids,
                                               ttl_ms=60_000, sender_agent="prefill-1"),
                            timeout=10)
        prefill_a = _in_thread(lambda: worker_pb2_grpc.PrefillWorkerStub(p1ch).Prefill(
            wpb.PrefillRequest(request_id="stale-a", prompt_token_ids=a_ids,
                               sampling=sampling(1), destination_follows=True), timeout=120),
            results, "prefill_a")
        time.sleep(1.0)  # computed; its KV waits for a destination
        os.kill(p1.popen.pid, signal.SIGSTOP)
        try:
            set_dest = _in_thread(lambda: worker_pb2_grpc.PrefillWorkerStub(p1ch).SetDestination(
                wpb.SetDestinationRequest(request_id="stale-a",
                                          dest=_dest(decode.address, lease_a)), timeout=120),
                results, "set_dest")
            assert d.Release(wpb.LeaseRequest(request_id="stale-a", lease_id=lease_a.lease_id),
                             timeout=10).ok
            # Held for prefill-1 until no router listed it for the grace; then reused.
            deadline = time.monotonic() + 40
            while _free(cluster, "decode-1") != baseline["decode-1"]:
                assert time.monotonic() < deadline, "A's blocks were never released"
                time.sleep(0.1)
            lease_b = d.Reserve(wpb.ReserveRequest(
                request_id="stale-b", prompt_token_ids=b_ids, ttl_ms=60_000,
                sender_agent="prefill-2", sender_address=p2.address), timeout=10)
            reused = set(lease_a.block_ids) & set(lease_b.block_ids)
            assert reused, (list(lease_a.block_ids), list(lease_b.block_ids))
            first = worker_pb2_grpc.PrefillWorkerStub(p2ch).Prefill(
                wpb.PrefillRequest(request_id="stale-b", prompt_token_ids=b_ids,
                                   sampling=sampling(1), dest=_dest(decode.address, lease_b)),
                timeout=60).first_token_id
        finally:
            os.kill(p1.popen.pid, signal.SIGCONT)
        # prefill-1 runs again and reads A's destination: it must not write.
        set_dest.join(60)
        prefill_a.join(60)
        assert not set_dest.is_alive() and not prefill_a.is_alive()
        assert isinstance(results["prefill_a"], grpc.RpcError), \
            "the wedged sender delivered A's KV into blocks reused since"
        assert results["prefill_a"].code() == grpc.StatusCode.UNAVAILABLE
        tokens = [first]
        for msg in d.Decode(wpb.DecodeRequest(request_id="stale-b", lease_id=lease_b.lease_id,
                                              first_token_id=first,
                                              sampling=sampling(MAX_TOKENS, ignore_eos=True)),
                            timeout=60):
            tokens.extend(msg.token_ids)
    ref = LLM(demo_model_dir, num_blocks=256).generate(
        b_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
    assert tokens == ref.token_ids, "B's KV was overwritten by the stale sender"
    assert cluster.wait_free_blocks(baseline, timeout=30) == baseline
    # The wedged worker said why, and serves again once it settled.
    assert "fenced itself" in p1.log.read_text() or "cannot prove" in p1.log.read_text()
