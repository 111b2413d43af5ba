"""Disaggregated serving with tensor parallelism in the pools: a prefill worker of TP=A streams
its prompt KV to a decode worker of TP=B (real router, worker and rank processes, real NIXL).

For (A, B) in (2, 1), (1, 2), (2, 2), (2, 1) / (1, 2) / (2, 4) with the smaller side in two
KV head groups, and (2, 1) heads first inside a block (``--kv-layout heads``): greedy tokens equal
the engine alone and transformers, for prompts within one block, across blocks and chunked;
every KV block of both workers comes back; each rank of a TP worker has its own NIXL agent.
A rank of a TP=2 decode worker killed mid-stream: its requests migrate, output identical.

One router serves the module (``pools``): each test asks for the workers it needs by their
arguments, a worker the previous test left of the same arguments is kept and any other stopped
(the cases run in an order where one side carries over), and each test's requests carry a
prefix-cache salt of their own, so a kept worker holds none of their blocks: every prompt is
computed in full by the prefill worker and every block of it sent (asserted).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from cluster import Cluster, Proc
from hf_models import hf_greedy

from kvrelay.client import sampling
from kvrelay.engine.llm import LLM
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kv_transfer.messages import PeerInfo
from kvrelay.proto import worker_pb2 as wpb
from kvrelay.proto import worker_pb2_grpc

pytestmark = pytest.mark.slow

LENGTHS = (5, 17, 300)
GEN = 8


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> LLM:
    return LLM(demo_model_dir, num_blocks=256)


@pytest.fixture(scope="module")
def want(demo_model_dir, llm) -> dict[int, list[int]]:
    """The engine alone (TP=1) per prompt length, checked against transformers."""
    sp = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    out = {}
    for i, n in enumerate(LENGTHS):
        ids = prompt_ids(n, i)
        out[n] = llm.generate(ids, sp)[0].token_ids
        assert out[n] == hf_greedy(demo_model_dir, ids, GEN).token_ids
    return out


def _tp(n: int) -> tuple[str, ...]:
    return ("--tensor-parallel-size", str(n)) if n > 1 else ()


GROUPS = ("--kv-head-groups", "2")
# Heads first inside a block (the CUDA default; on CPU through SDPA): each rank writes its run
# of heads per block straight into the peer's blocks, whatever the split.
HEADS = ("--kv-layout", "heads", "--attention-backend", "sdpa")


class Pools:
    """The module's cluster: one router, and the workers the current test asked for."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.args: dict[str, tuple[str, ...]] = {}  # worker name -> its extra arguments

    def use(self, **roles: list[tuple[str, ...]]) -> dict[str, list[Proc]]:
        """Exactly these workers, per role (each named by its extra arguments), running and
        registered; a running worker of the same arguments is kept, any other stopped."""
        c = self.cluster
        out: dict[str, list[Proc]] = {}
        for role in ("prefill", "decode"):
            spare = c.live(role)
            out[role] = []
            for extra in roles.get(role, []):
                p = next((p for p in spare if self.args[p.name] == extra), None)
                if p is None:
                    p = c.add_worker(role, extra=extra, wait=False)
                    self.args[p.name] = extra
                else:
                    spare.remove(p)
                out[role].append(p)
            for p in spare:
                c.kill(p, signal.SIGTERM)
                assert c.wait_exit(p, 60) is not None, f"{p.name} did not stop"
        for p in c.workers:
            if p.alive() and p.ready is None:
                c.wait_ready(p)
        c.wait_registered()
        live = {p.name for p in c.workers if p.alive()}
        deadline = time.monotonic() + 30
        while {w.info.worker_id for w in c.registered()} != live:
            assert time.monotonic() < deadline, "stopped workers stay registered"
            time.sleep(0.05)
        return out


@pytest.fixture(scope="module")
def pools(demo_model_dir, tmp_path_factory):
    with Cluster(demo_model_dir, tmp_path_factory.mktemp("tp"), prefill=0, decode=0,
                 worker_args=("--max-num-batched-tokens", "128")) as c:
        yield Pools(c)


# Ordered so that one side carries over from each case to the next (and into the kill test's
# TP=1 prefill and TP=2 decode workers): 11 worker starts for the 8 tests instead of 17.
@pytest.mark.parametrize(("p_tp", "d_tp", "p_extra", "d_extra"), [
    (2, 1, HEADS, HEADS),
    # The smaller side in two KV head groups: the writes go rank to rank, no repacking.
    (2, 4, GROUPS, ()), (2, 1, (), GROUPS),
    (2, 1, (), ()), (2, 2, (), ()), (1, 2, GROUPS, ()), (1, 2, (), ())],
    ids=["2h-1h", "2g-4", "2-1g", "2-1", "2-2", "1g-2", "1-2"])
def test_greedy_identical_across_tp_sizes(pools, request, want, p_tp: int, d_tp: int,
                                          p_extra: tuple[str, ...],
                                          d_extra: tuple[str, ...]) -> None:
    decode = pools.use(prefill=[_tp(p_tp) + p_extra], decode=[_tp(d_tp) + d_extra])["decode"][0]
    c = pools.cluster
    # Each rank has its own NIXL agent over its own KV (rank 0's alone registers none of the
    # others'), named in the endpoint with the transport ranks (its KV head groups) it holds.
    info = _endpoint(c, decode)
    groups = 2 if d_extra == GROUPS else 1
    assert [a.slots for a in info.rank_agents] == [
        tuple(range(r * groups, (r + 1) * groups)) for r in range(1, d_tp)]
    baseline = c.free_blocks()
    with c.client() as cl:
        for i, n in enumerate(LENGTHS):
            got = cl.generate(prompt_ids(n, i), sampling(GEN, 0.0, ignore_eos=True),
                              cache_salt=request.node.name)
            assert got.finish_reason == "length"
            assert got.token_ids == want[n], f"P={p_tp} D={d_tp}, prompt of {n} tokens"
            # The KV came from the prefill worker: the decode worker never prefilled it, and
            # no worker held any of it before.
            names = [e.name for e in got.trace]
            assert "received" in names and "prefill_end" in names, names
            assert got.usage.cached_prompt_tokens == 0
    assert c.wait_free_blocks(baseline) == baseline


def test_choices_forked_on_a_tp_decode_worker_copy_their_shared_block_on_every_rank(
        pools) -> None:
    """n > 1 on a TP=2 decode worker: the choices share the prompt's blocks, and before a
    choice writes the last, partly filled one, every rank copies its heads of it (copy-on-write
    broadcast as a step of its own). Had a rank not copied, the choices would write into one
    block there and read each other's KV: each choice equals the single request of its seed."""
    pools.use(prefill=[()], decode=[_tp(2)])
    c = pools.cluster
    baseline = c.free_blocks()
    ids = prompt_ids(37, 99)  # not a whole number of blocks: the last one is shared, partly
    params = {"ignore_eos": True, "top_k": 20}
    with c.client() as cl:
        choices: list[list[int]] = [[], [], []]
        for msg in cl.stream(ids, sampling(GEN, 1.0, n=3, seed=11, **params), timeout=120):
            choices[msg.index] += msg.token_ids
        singles = [cl.generate(ids, sampling(GEN, 1.0, seed=11 + k, **params)).token_ids
                   for k in range(3)]
    assert choices == singles
    assert len({tuple(t) for t in choices}) > 1  # the choices did sample apart
    assert c.wait_free_blocks(baseline) == baseline


def _endpoint(c: Cluster, worker: Proc) -> PeerInfo:
    """A decode worker's KV endpoint, as the router fetches it."""
    with grpc.insecure_channel(worker.address) as ch:
        got = worker_pb2_grpc.DecodeWorkerStub(ch).GetTransferInfo(
            wpb.TransferInfoRequest(), metadata=c.metadata, timeout=10)
    return PeerInfo.from_bytes(got.peer_info)


def _kill_under_load(client: Callable[[int], None], n: int, busy: Callable[[], bool], pid: int,
                     never: str) -> None:
    """Run ``client(i)`` for ``i < n`` on threads, kill ``pid`` (a rank) once ``busy()``, and
    wait for every request to end (none may hang)."""
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not busy():
        assert time.monotonic() < deadline, never
        assert all(t.is_alive() for t in threads), "requests ended before the kill"
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a request hung"


def _rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel rank processes of a worker: the children of its multiprocessing fork
    server (a child of the worker)."""
    procs: dict[int, tuple[int, bytes]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                procs[int(d)] = (ppid, f.read())
        except (OSError, IndexError, ValueError):
            continue
    servers = {pid for pid, (ppid, cmd) in procs.items()
               if ppid == worker_pid and b"forkserver" in cmd}
    # The harness forks that server from the worker (kvrelay/forking.py), so it has the
    # worker's command line; an interpreter multiprocessing started would have its own.
    assert all(procs[s][1] == procs[worker_pid][1] for s in servers), "rank server exec'd"
    return [pid for pid, (ppid, _) in procs.items() if ppid in servers]


def test_a_killed_rank_of_a_tp_decode_worker_migrates_its_requests(pools, llm) -> None:
    """Rank 1 of a TP=2 decode worker dies mid-stream: the worker exits (its engine can never
    step again), the router migrates its requests to the other decode worker, and every output
    equals the engine alone's, token for token."""
    max_tokens = 160
    prompts = [prompt_ids(n, 50 + i) for i, n in enumerate((12, 40, 9, 70))]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    want = [llm.generate(p, sp)[0].token_ids for p in prompts]
    tp_decode = pools.use(prefill=[()], decode=[_tp(2), ()])["decode"][0]
    c = pools.cluster
    ranks = _rank_pids(tp_decode.popen.pid)
    assert len(ranks) == 1, ranks
    got: dict[int, tuple[list[int], list[str]]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with c.client() as cl:
                r = cl.generate(prompts[i], sampling(max_tokens, 0.0, ignore_eos=True),
                                cache_salt="killed-rank")
                got[i] = (list(r.token_ids), [e.name for e in r.trace])
        except BaseException as e:  # asserted below
            errors.append(e)

    _kill_under_load(client, len(prompts), lambda: c.status(tp_decode).load.running >= 1,
                     ranks[0], "the TP decode worker never streamed")
    assert not errors, errors
    assert c.wait_exit(tp_decode, 60) == 70
    migrated = [i for i, (_, trace) in got.items() if "migrate" in trace]
    assert migrated, "no request was on the TP decode worker"
    for i, (tokens, _) in got.items():
        assert tokens == want[i], f"request {i} (migrated: {i in migrated})"


def test_a_killed_rank_of_a_tp_prefill_worker_mid_transfer_loses_no_request(pools, llm) -> None:
    """Rank 1 of a TP=2 prefill worker dies while its ranks stream prompt KV (chunked, so every
    step writes): the writes it owed fail, its worker exits, the router sends those prefills to
    the other prefill worker, every output equals the engine alone's, and the decode worker's
    blocks (the reservations the dead worker was writing into) all come back."""
    prompts = [prompt_ids(n, 80 + i) for i, n in enumerate((600, 500, 640, 560, 610, 520))]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [llm.generate(p, sp)[0].token_ids for p in prompts]
    got_pools = pools.use(prefill=[_tp(2), ()], decode=[()])
    tp_prefill, decode = got_pools["prefill"][0], got_pools["decode"][0]
    c = pools.cluster
    ranks = _rank_pids(tp_prefill.popen.pid)
    assert len(ranks) == 1, ranks
    baseline = c.status(decode).load.free_blocks
    got: dict[int, list[int]] = {}
    retried: list[int] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with c.client() as cl:
                r = cl.generate(prompts[i], sampling(6, 0.0, ignore_eos=True),
                                cache_salt="killed-prefill-rank")
                got[i] = list(r.token_ids)
                starts = [e.worker for e in r.trace if e.name == "prefill_start"]
                if tp_prefill.name in starts[:-1]:  # begun there, finished elsewhere
                    retried.append(i)
        except BaseException as e:  # asserted below
            errors.append(e)

    _kill_under_load(client, len(prompts),
                     lambda: c.status(tp_prefill).load.queued_prompt_tokens > 0, ranks[0],
                     "the TP prefill worker never prefilled")
    assert not errors, errors
    assert c.wait_exit(tp_prefill, 60) == 70
    assert retried, "no prefill was on the TP worker when its rank died"
    assert got == dict(enumerate(want))
    deadline = time.monotonic() + 30
    while c.status(decode).load.free_blocks != baseline:
        assert time.monotonic() < deadline, "the decode worker kept blocks of the dead writer"
        time.sleep(0.1)
